"""The one progress helper of dclens: every slow call (analysis over a
dataset, patching sweeps, attribution, training, the synthetic benchmark, Hub
downloads) takes ``progress=`` and reports through :func:`bar`.

    progress=None (default)  a tqdm.auto bar where someone watches: a widget in
                             Jupyter when ipywidgets is installed, a text bar
                             in a terminal; in a log that is not a terminal
                             (a file, CI), a few plain lines instead
                             ("desc: 25% (250/1000) 3.1 s"), never a
                             carriage-return line per update
    progress=True            a tqdm.auto bar even when stderr is not a terminal
    progress=False           nothing

tqdm.auto would warn ("IProgress not found") in a notebook without
ipywidgets: that warning is not shown, the text bar is used.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterable, Sized

from .checks import ArgumentTypeError

_PLAIN_STEPS = 4  # plain lines: at 25, 50, 75 and 100 %


def _in_notebook() -> bool:
    ip = sys.modules.get("IPython")
    try:
        shell = ip.get_ipython() if ip is not None else None
        return shell is not None and "IPKernelApp" in shell.config
    except Exception:  # noqa: BLE001 -- any doubt: not a notebook
        return False


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _tqdm_auto():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tqdm.auto's "IProgress not found" (no ipywidgets)
        from tqdm.auto import tqdm  # lazy: tqdm loads with the first progress bar
    return tqdm


def mode(progress: bool | None) -> str:
    """What a progress= argument asks for, here and now.

    Parameters
    ----------
    progress : bool or None
        None: a bar where someone watches (a notebook or a terminal), else plain lines;
        True: a bar; False: nothing.

    Returns
    -------
    str
        "bar" (tqdm.auto), "lines" (Plain) or "none" (Silent).

    Raises
    ------
    dclens.ArgumentTypeError
        `progress` is not None, True or False.
    """
    if progress is None:
        return "bar" if _in_notebook() or _stderr_is_terminal() else "lines"
    if not isinstance(progress, (bool, int)):
        raise ArgumentTypeError("progress must be None, True or False, not %r" % (progress,))
    return "bar" if progress else "none"


class Plain:
    """A few plain lines on stderr (what a log file gets): the start, every
    quarter, the end. The subset of tqdm's interface dclens uses.

    Parameters
    ----------
    iterable : iterable or None
        What to iterate over (``for x in Plain(items)``), or None to count with update().
    total : int or None
        The number of steps; None: len(iterable) when it has one (no percentages without).
    desc : str
        The label that starts each line ("progress" when empty).
    unit : str
        The unit of the counts ("it", "batch", "line", ...).
    initial : int
        The count to start from (a resumed run).
    **_ignored
        Other tqdm arguments (leave=, position=, ...), ignored.
    """

    def __init__(
        self,
        iterable: Iterable | None = None,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        initial: int = 0,
        **_ignored,
    ):
        self.iterable = iterable
        if total is None and isinstance(iterable, Sized):
            total = len(iterable)
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.postfix = ""
        self._t0 = time.monotonic()
        # the first quarter not yet passed (a resumed run starts past some)
        self._next = 1 + (initial * _PLAIN_STEPS // total if total else 0)
        self._closed = False
        self._say("start" if not initial else "resumed at %d" % initial)

    def _say(self, what: str) -> None:
        print(
            "%s: %s%s" % (self.desc or "progress", what, " (%s)" % self.postfix if self.postfix else ""),
            file=sys.stderr,
            flush=True,
        )

    def update(self, n: int = 1) -> None:
        """Count `n` more steps; print a line for the last quarter of `total` this passed.

        Parameters
        ----------
        n : int
            Steps done since the last update.
        """
        self.n += n
        if self.total:
            # one line per update, for the last quarter it passed: a jump over
            # several quarters says the count once ("25% (12/24)" then "50%
            # (12/24)" read as a repeat)
            passed = self._next
            while passed < _PLAIN_STEPS and self.n * _PLAIN_STEPS >= passed * self.total:
                passed += 1
            if passed > self._next:
                self._next = passed
                self._say(
                    "%d%% (%d/%d %s) %.1f s"
                    % (100 * (passed - 1) // _PLAIN_STEPS, self.n, self.total, self.unit, time.monotonic() - self._t0)
                )

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kw) -> None:
        """Set what the next lines show in parentheses after the count, as "key=value, ...".

        Parameters
        ----------
        ordered_dict : mapping or None
            The key=value pairs, in order.
        refresh : bool
            tqdm's argument, ignored (the next line shows them).
        **kw
            More pairs, after those of ordered_dict.
        """
        d = dict(ordered_dict or {}, **kw)
        self.postfix = ", ".join("%s=%s" % kv for kv in d.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Set what the next lines show in parentheses after the count.

        Parameters
        ----------
        s : str
            The text ("" shows nothing).
        refresh : bool
            tqdm's argument, ignored.
        """
        self.postfix = s

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        """Set the label that starts the next lines.

        Parameters
        ----------
        desc : str
            The label ("progress" when empty).
        refresh : bool
            tqdm's argument, ignored: each line is printed whole, with the label it has
            when printed.
        """
        self.desc = desc

    def refresh(self) -> None:
        """Nothing: lines are printed as quarters pass (tqdm's redraw has no equivalent)."""

    def write(self, s: str) -> None:
        """Print a message on stderr, on its own line (tqdm.write's place for text).

        Parameters
        ----------
        s : str
            The message.
        """
        print(s, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Print the last line (the count, the unit, the seconds since the start), once."""
        if self._closed:
            return
        self._closed = True
        self._say(
            "done, %d%s %s in %.1f s"
            % (self.n, "/%d" % self.total if self.total else "", self.unit, time.monotonic() - self._t0)
        )

    def __iter__(self):
        try:
            for x in self.iterable:
                yield x
                self.update(1)
        finally:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Silent(Plain):
    """progress=False: the same interface, no output."""

    def _say(self, what: str) -> None:
        pass

    def write(self, s: str) -> None:
        """Print nothing (progress=False).

        Parameters
        ----------
        s : str
            The message, dropped.
        """


def bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    progress: bool | None = None,
    unit: str = "it",
    **kw,
):
    """A progress bar for a progress= argument (see the module doc).

    Use it as tqdm: iterate over it, or call update(n) then close().

    Parameters
    ----------
    iterable : iterable or None
        What to iterate over, or None to count with update().
    total : int or None
        The number of steps (None: len(iterable) where it has one).
    desc : str
        The bar's label.
    progress : bool or None
        None: a bar where someone watches, plain lines in a log; True: a bar; False: nothing.
    unit : str
        The unit of the counts.
    **kw
        Further tqdm arguments (leave=, position=, initial=, ...).

    Returns
    -------
    tqdm.auto.tqdm or Plain or Silent
        tqdm.auto's bar (a widget in Jupyter with ipywidgets), Plain lines, or Silent.

    Raises
    ------
    dclens.ArgumentTypeError
        `progress` is not None, True or False.
    """
    m = mode(progress)
    if m == "bar":
        return _tqdm_auto()(iterable, total=total, desc=desc, unit=unit, **kw)
    return (Plain if m == "lines" else Silent)(iterable, total=total, desc=desc, unit=unit, **kw)


def hub_tqdm_class(progress: bool | None):
    """The tqdm class huggingface_hub's snapshot_download gets.

    Parameters
    ----------
    progress : bool or None
        As for bar(): where mode(progress) is "bar", the Hub's per-file bars are tqdm.auto's;
        otherwise they are disabled.

    Returns
    -------
    type
        tqdm.auto.tqdm, or a subclass of it that shows nothing.

    Raises
    ------
    dclens.ArgumentTypeError
        `progress` is not None, True or False.
    """
    tqdm = _tqdm_auto()
    if mode(progress) == "bar":
        return tqdm

    class _Quiet(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            k["disable"] = True
            super().__init__(*a, **k)

    return _Quiet
