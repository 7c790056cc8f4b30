#!/usr/bin/env python3
"""Shim: the trace summary lives in ``pdgate.sim.trace``."""

import os
import sys

try:
    from pdgate.sim.trace import main
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from pdgate.sim.trace import main

if __name__ == "__main__":
    sys.exit(main())
