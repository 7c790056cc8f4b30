#!/usr/bin/env python3
"""Write docs/configuration.md from the config model (pdgate.settings.config_reference).

    python scripts/gen_config_docs.py           # rewrite the file
    python scripts/gen_config_docs.py --check   # exit 1 if the file is stale
"""

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
try:
    from pdgate.settings import config_reference
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(ROOT, "python"))
    from pdgate.settings import config_reference

PATH = os.path.join(ROOT, "docs", "configuration.md")


def main() -> int:
    text = config_reference()
    if "--check" in sys.argv[1:]:
        with open(PATH) as f:
            if f.read() != text:
                print(f"{PATH} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
                return 1
        return 0
    with open(PATH, "w") as f:
        f.write(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
