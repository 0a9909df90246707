"""The dclens command line (commands; also ``python -m dclens`` and
``python -m dclens.cli``)."""

from .commands import COMMANDS, MODEL_HELP, main, parsers

__all__ = ["COMMANDS", "MODEL_HELP", "main", "parsers"]
