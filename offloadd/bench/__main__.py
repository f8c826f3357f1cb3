import sys

from offloadd.bench import main

sys.exit(main())
