"""python -m dclens.cli: the dclens command line."""

import sys

from .commands import main

sys.exit(main())
