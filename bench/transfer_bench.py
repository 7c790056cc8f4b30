#!/usr/bin/env python3
"""Shim: the KV transfer benchmark lives in ``pdgate.bench.transfer``
(contenders in ``pdgate.bench.transfer_peers``).

    python bench/transfer_bench.py                 # tcp and sm, full sizes
    python bench/transfer_bench.py --quick         # small sizes (smoke)

Writes ``bench/results/transfer.json``; see the module's docstring.
"""

import os
import sys

try:
    from pdgate.bench.transfer import main
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from pdgate.bench.transfer import main

if __name__ == "__main__":
    sys.exit(main())
