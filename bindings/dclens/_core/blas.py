"""Which BLAS and which kernels the CPU backend runs, and a warning when the
kernels are slower than the CPU allows.

The engine is built against PyPI's scipy-openblas32 (the OpenBLAS numpy and SciPy
ship; CMake -DDCLENS_BLAS=system builds against the system's libopenblas
instead). OpenBLAS picks its kernel set once, when the library loads, from the
CPU it detects (or from OPENBLAS_CORETYPE). A CPU an old OpenBLAS does not
recognise, such as Debian 12's 0.3.21 on a Sapphire-Rapids-class Xeon, gets the
generic "Prescott" (SSE3) kernels, 4-6x slower than SkylakeX there (issue 48).
`load` warns (BlasWarning, once per process) when the kernels are below the
CPU's vector width and nobody pinned them, saying what to do.

    dclens.blas.kernel()     # "Cooperlake", "SkylakeX", "Haswell", "Prescott", ...
    dclens.blas.library()    # "scipy-openblas32" or "system libopenblas"
    dclens.blas.config()     # the library's build line: "OpenBLAS 0.3.34 DYNAMIC_ARCH ..."
    dclens.blas.path()       # the shared library file the process loaded
"""

import os
import warnings
from typing import Optional

from .runner import blas_info
from .warning_types import BlasWarning

# OpenBLAS kernel names (openblas_get_corename) by the widest vector
# instructions they use: 3 AVX-512, 2 AVX2 + FMA, 1 AVX. Names not listed
# are treated as unknown (never warned about), except the SSE-era fallbacks.
_LEVEL = {
    "skylakex": 3,
    "cooperlake": 3,
    "sapphirerapids": 3,
    "haswell": 2,
    "zen": 2,
    "excavator": 2,
    "sandybridge": 1,
    "bulldozer": 1,
    "piledriver": 1,
    "steamroller": 1,
}
_SSE = {"prescott", "katmai", "coppermine", "northwood", "banias", "core2", "penryn", "dunnington", "nehalem"}
_SSE |= {"atom", "opteron", "opteron_sse3", "barcelona", "bobcat", "nano", "generic"}
# what to pin for a CPU of each level
_PIN = {3: "SkylakeX", 2: "Haswell", 1: "Sandybridge"}
_NAMES = {3: "AVX-512", 2: "AVX2", 1: "AVX"}


def library() -> str:
    """The BLAS the engine was built with.

    Returns
    -------
    str
        "scipy-openblas32" (PyPI's, the default build) or "system libopenblas".
    """
    return blas_info()[0]


def config() -> str:
    """The loaded BLAS library's own build line (openblas_get_config).

    Returns
    -------
    str
        Version, DYNAMIC_ARCH, kernel set and MAX_THREADS, as OpenBLAS prints them
        ("OpenBLAS 0.3.34 DYNAMIC_ARCH NO_AFFINITY Cooperlake MAX_THREADS=64"); "" where
        the library cannot say.
    """
    return blas_info()[1].strip()


def path(maps: str = "/proc/self/maps") -> str:
    """The file of the BLAS library the engine runs, as this process mapped it.

    Parameters
    ----------
    maps : str
        The memory map to read (Linux's /proc/self/maps by default).

    Returns
    -------
    str
        The path of libscipy_openblas.so (or the system's libopenblas.so.0 for a
        -DDCLENS_BLAS=system build); "" where it cannot be read.
    """
    want = "libscipy_openblas" if library() == "scipy-openblas32" else "libopenblas"
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[-1]).startswith(want):
                    return parts[-1]
    except OSError:
        pass
    return ""


def symbol(name: str) -> str:
    """The name a BLAS function has in the engine's library (for ctypes, benchmarks).

    Parameters
    ----------
    name : str
        The standard name ("cblas_sgemm", "openblas_set_num_threads").

    Returns
    -------
    str
        scipy-openblas32's prefixed name ("scipy_cblas_sgemm"), or the name itself for a
        build against the system's libopenblas.
    """
    return ("scipy_" + name) if library() == "scipy-openblas32" else name


def kernel() -> str:
    """The kernel set the engine's OpenBLAS chose when it loaded.

    Returns
    -------
    str
        openblas_get_corename's answer ("Cooperlake", "SkylakeX", "Haswell", "Prescott",
        ...), or "" if the library cannot say.
    """
    return blas_info()[2]


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of the first CPU of a cpuinfo file.

    Parameters
    ----------
    path : str
        The file to read (Linux's /proc/cpuinfo by default).

    Returns
    -------
    set of str
        The words of its first "flags" line ("avx2", "fma", "avx512f", ...); empty where
        there is no such file or line.
    """
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_level(flags: set[str]) -> int:
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return 3
    if {"avx2", "fma"} <= flags:
        return 2
    return 1 if "avx" in flags else 0


def advice(core: str, flags: set[str], blas: str = "scipy-openblas32") -> Optional[str]:
    """The warning's text when an OpenBLAS kernel set uses narrower vectors than a CPU has.

    Parameters
    ----------
    core : str
        An OpenBLAS kernel name, as kernel() gives it (case and surrounding blanks ignored).
    flags : set of str
        The CPU's instruction-set flags, as cpu_flags() gives them.
    blas : str
        The library, as library() names it: the advice differs for the system's libopenblas.

    Returns
    -------
    str or None
        The advice, naming what to upgrade or the OPENBLAS_CORETYPE to start Python with,
        when the kernels' vector width (AVX-512, AVX2 + FMA, AVX, SSE) is below the CPU's;
        None when it is not, and for a kernel name it does not know.
    """
    name = core.strip().lower()
    level = _LEVEL.get(name, 0 if name in _SSE else None)
    cpu = _cpu_level(flags)
    if level is None or level >= cpu:
        return None
    if blas == "scipy-openblas32":
        fix = "Upgrade it (pip install -U scipy-openblas32: a newer OpenBLAS knows more CPUs), or start"
    else:
        fix = "Rebuild dclens against PyPI's scipy-openblas32 (the default, CMake -DDCLENS_BLAS=scipy), or start"
    return (
        "%s chose its %s kernels, but this CPU has %s: matrix products run several times slower than "
        "they could (OpenBLAS did not recognise the CPU, or was built without its kernels). %s Python "
        "with OPENBLAS_CORETYPE=%s in the environment (it is read when the library loads) to use them."
        % (blas, core, _NAMES[cpu], fix, _PIN[cpu])
    )


_warned: list[str] = []  # the text of the one warning this process gave


def check(stacklevel: int = 3) -> Optional[str]:
    """Warn (BlasWarning), once per process, when the engine's BLAS kernels are below this CPU's.

    Nothing is checked when OPENBLAS_CORETYPE is set (the kernels were chosen), and a
    process is warned once: later loads return the same text without a warning.

    Parameters
    ----------
    stacklevel : int
        warnings.warn's stacklevel: which caller's line the warning names.

    Returns
    -------
    str or None
        The warning's text (advice()), or None when there was nothing to warn about.

    Warns
    -----
    BlasWarning
        When the kernels are narrower than the CPU allows (the first time only).
    """
    if "OPENBLAS_CORETYPE" in os.environ:
        return None
    text = advice(kernel(), cpu_flags(), library())
    if text is not None and not _warned:
        _warned.append(text)
        warnings.warn(text, BlasWarning, stacklevel=stacklevel)
    return text
