"""``python -m benchmarks``: see ``benchmarks``."""

import sys

from benchmarks import main

sys.exit(main())
