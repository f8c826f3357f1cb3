"""``python -m offloadd`` is ``offloadd``.

``install`` is dispatched before the command line is imported: it needs the standard library
only, so it runs from the wheel on a node where nothing else is installed yet
(``PYTHONPATH=offloadd-*.whl python3 -m offloadd install``).
"""

import sys

if sys.argv[1:2] == ["install"]:
    from offloadd.install import main_argv

    raise SystemExit(main_argv(sys.argv[2:]))

from offloadd.cli import main

raise SystemExit(main())
