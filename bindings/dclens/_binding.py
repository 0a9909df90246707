"""Load the engine's BLAS, then the engine module, with a dclens.Error where either fails.

The engine is built against PyPI's scipy-openblas32 (the OpenBLAS numpy and SciPy
ship: DYNAMIC_ARCH, every symbol prefixed ``scipy_``), a runtime dependency of
the package. Importing ``scipy_openblas32`` loads its ``libscipy_openblas.so``
into the process, so the dynamic linker finds it (by its soname) for
``dclens._engine`` wherever pip installed the two packages; the module's run path
(``$ORIGIN/../scipy_openblas32/lib``) finds it too when they share a
site-packages. A build against the system's libopenblas (CMake
``-DDCLENS_BLAS=system``) needs no wheel: a missing ``scipy_openblas32`` is then
not an error.

This module runs first in ``dclens/__init__.py``: every later ``from ._engine
import ...`` finds the module already imported.
"""

from __future__ import annotations

from ._checks import Error

PACKAGE = "scipy-openblas32"


def _blas_error(why: str) -> Error:
    return Error(
        "dclens could not load its BLAS (%s, library libscipy_openblas.so): %s. "
        "Install it with: pip install --force-reinstall %s" % (PACKAGE, why, PACKAGE)
    )


def load_engine() -> None:
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
        from ._engine import lib  # noqa: F401  (the module, loaded once for every later import)
    except ImportError as e:
        text = str(e)
        if any(w in text for w in ("openblas", "cblas", "scipy_")):  # the library, or a symbol of it
            raise _blas_error(wheel_error or "the engine module cannot use it: %s" % text) from None
        raise Error("dclens could not load its engine module dclens._engine: %s" % text) from None
