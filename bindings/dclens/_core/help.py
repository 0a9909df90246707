"""The help formatter of every dclens command: argparse's, with each option's
default appended where it says something (not None, not False) and the
help text does not already give it."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        d = action.default
        if (
            d is None
            or d is False
            or d is argparse.SUPPRESS
            or "default" in h
            or not action.option_strings
            or action.required
        ):
            return h
        return h + " (default: %(default)s)"
