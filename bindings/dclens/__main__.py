"""python -m dclens: the dclens command line (dclens.cli)."""

import sys

from .cli import main

sys.exit(main())
