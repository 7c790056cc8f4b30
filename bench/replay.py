#!/usr/bin/env python3
"""Open-loop replay of a production trace against an OpenAI-compatible server.

Example (Azure code trace, first minute, twice slower, lengths capped)::

    python bench/replay.py --url http://127.0.0.1:8000 --model NAME --tokenizer DIR \\
        --trace ../shared/traces/azure2023_code.csv --start 0 --duration 60 \\
        --time-scale 2.0 --max-prompt-tokens 1024 --max-output-tokens 128 \\
        --slo ttft:500 --slo tpot:50 --json out.json

SLO values are milliseconds unless suffixed with ``s``. See
``python/pdgate/bench/replay.py`` for the library API.
"""

import os
import sys

try:
    from pdgate.bench.replay import main
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from pdgate.bench.replay import main

if __name__ == "__main__":
    sys.exit(main())
