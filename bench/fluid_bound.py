#!/usr/bin/env python3
"""Shim: the benchmark lives in ``pdgate.bench.fluid``."""

import os
import sys

try:
    from pdgate.bench.fluid import main
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from pdgate.bench.fluid import main

if __name__ == "__main__":
    sys.exit(main())
