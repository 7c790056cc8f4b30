"""``python -m pdgate`` == the ``pdgate`` command."""

import sys

from pdgate.cli import main

sys.exit(main())
