"""``python -m offloadd`` is ``offloadd``."""

from offloadd.cli import main

raise SystemExit(main())
