"""Every warning class of dclens, in one place (each is also reachable from the module
that raises it: dclens.blas.BlasWarning, dclens.patching.PatchingWarning, ...).

Filter one kind with the standard library, e.g.
``warnings.simplefilter("ignore", dclens.LoadWarning)``.
"""

from __future__ import annotations


class BlasWarning(UserWarning):
    """The CPU backend's BLAS kernels are slower than this CPU allows."""

    __module__ = "dclens"  # printed and pickled as its public name, dclens.BlasWarning


class LoadWarning(UserWarning):
    """Something about a checkpoint worth knowing, said once when it is loaded
    (e.g. key-side weights of a query-wise checkpoint that are ignored)."""

    __module__ = "dclens"  # printed and pickled as its public name, dclens.LoadWarning


class ContextWarning(UserWarning):
    """A prompt longer than the context the model was trained for
    (model.cfg.n_ctx): the pass runs, but past that length the model has
    seen no position in training and its outputs mean little."""

    __module__ = "dclens"  # printed and pickled as its public name, dclens.ContextWarning


class MaskedPairWarning(UserWarning):
    """A composition map was asked for a (query, key) pair the mask hides."""


class PatchingWarning(UserWarning):
    """The clean and corrupted baselines of a patching sweep do not make a
    meaningful 0..1 scale for normalized() (too close, or in the wrong order)."""

    __module__ = "dclens"  # printed and pickled as its public name, dclens.PatchingWarning
