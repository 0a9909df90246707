"""python -m dclens: the dclens command line (dclens.cli)."""

import sys

from .cli.commands import main

sys.exit(main())
