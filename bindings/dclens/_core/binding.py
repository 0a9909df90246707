"""The engine binding: the BLAS, then the engine module (ffi, lib), and engine status -> Error.

Only four modules of the package import this one (tests/api/test_imports.py refuses any
other): runner.py (every call on a loaded model, and the model-free queries), tapes.py
(gradient tapes), dictionaries.py (the sparse dictionaries) and heatmaps.py (the renderer). Nothing imports ``dclens._engine`` but
this module.

Loading: a dclens.Error names the library where it fails.

The engine is built against PyPI's scipy-openblas32 (the OpenBLAS numpy and SciPy
ship: DYNAMIC_ARCH, every symbol prefixed ``scipy_``), a runtime dependency of
the package. Importing ``scipy_openblas32`` loads its ``libscipy_openblas.so``
into the process, so the dynamic linker finds it (by its soname) for
``dclens._engine`` wherever pip installed the two packages; the module's run path
(``$ORIGIN/../scipy_openblas32/lib``) finds it too when they share a
site-packages. A build against the system's libopenblas (CMake
``-DDCLENS_BLAS=system``) needs no wheel: a missing ``scipy_openblas32`` is then
not an error.

``dclens/__init__.py`` imports this module (through runner) before anything else that
needs the engine.
"""

from __future__ import annotations

import os

from .checks import ArgumentError, Error, NotFoundError

PACKAGE = "scipy-openblas32"


def _blas_error(why: str) -> Error:
    return Error(
        "dclens could not load its BLAS (%s, library libscipy_openblas.so): %s. "
        "Install it with: pip install --force-reinstall %s" % (PACKAGE, why, PACKAGE)
    )


def _load_engine():
    """Load scipy-openblas32's library (if installed) and then dclens._engine.

    Raises
    ------
    dclens.Error
        When the BLAS library or the engine module cannot be loaded, naming the library and
        what to install.
    """
    wheel_error = None
    try:
        import scipy_openblas32  # noqa: F401  (loads libscipy_openblas.so, RTLD_GLOBAL)
    except ImportError as e:  # not installed: fine for a -DDCLENS_BLAS=system build
        wheel_error = "%s is not installed (%s)" % (PACKAGE, e)
    except OSError as e:  # installed, but its library does not load (wrong architecture, truncated...)
        raise _blas_error("its library does not load: %s" % e) from None
    try:
        from .._engine import ffi, lib  # here: after its BLAS, and its failure a dclens.Error
    except ImportError as e:
        text = str(e)
        if any(w in text for w in ("openblas", "cblas", "scipy_")):  # the library, or a symbol of it
            raise _blas_error(wheel_error or "the engine module cannot use it: %s" % text) from None
        raise Error("dclens could not load its engine module dclens._engine: %s" % text) from None
    return ffi, lib


ffi, lib = _load_engine()


def check_status(status: int, msg: str) -> None:
    """Error(msg) (or the status' name when msg is empty) unless the engine
    call that returned `status` succeeded."""
    if status != lib.DCS_OK:
        msg = msg or ffi.string(lib.dcs_status_name(status)).decode()
        if status == lib.DCS_ERR_ARG:
            raise ArgumentError(msg)
        if status == lib.DCS_ERR_IO and msg.endswith(os.strerror(2)):  # ENOENT
            raise NotFoundError(msg)
        raise Error(msg)
