"""Which OpenBLAS kernels the CPU backend runs, and a warning when they are
slower than the CPU allows.

OpenBLAS picks its kernel set once, when the library loads, from the CPU it
detects (or from OPENBLAS_CORETYPE). A CPU it does not recognise, such as a
virtual Intel Xeon that reports only "Intel(R) Xeon(R) Processor", gets its
generic "Prescott" (SSE3) kernels: on such a machine with AVX-512 the same
sgemm ran 4.7x slower than with the SkylakeX kernels (docs/benchmarks/diary.md, "lent GPU
machine"). `load` warns (BlasWarning) when the kernels are below the CPU's
vector width and nobody pinned them; the fix is to start Python with
OPENBLAS_CORETYPE set as the warning says (OpenBLAS reads it only at load).

    dclens.blas.kernel()     # "Cooperlake", "SkylakeX", "Haswell", "Prescott", ...
"""

import os
import warnings
from typing import Optional

from ._engine import ffi, lib

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


class BlasWarning(UserWarning):
    """The CPU backend's BLAS kernels are slower than this CPU allows."""


def kernel() -> str:
    """The kernel set the engine's OpenBLAS chose when it loaded.

    Returns
    -------
    str
        openblas_get_corename's answer ("Cooperlake", "SkylakeX", "Haswell", "Prescott",
        ...), or "" if the library cannot say.
    """
    return ffi.string(lib.dcs_blas_core()).decode(errors="replace")


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


def advice(core: str, flags: set[str]) -> Optional[str]:
    """The warning's text when an OpenBLAS kernel set uses narrower vectors than a CPU has.

    Parameters
    ----------
    core : str
        An OpenBLAS kernel name, as kernel() gives it (case and surrounding blanks ignored).
    flags : set of str
        The CPU's instruction-set flags, as cpu_flags() gives them.

    Returns
    -------
    str or None
        The advice, naming the OPENBLAS_CORETYPE to start Python with, when the kernels'
        vector width (AVX-512, AVX2 + FMA, AVX, SSE) is below the CPU's; None when it is
        not, and for a kernel name it does not know.
    """
    name = core.strip().lower()
    level = _LEVEL.get(name, 0 if name in _SSE else None)
    cpu = _cpu_level(flags)
    if level is None or level >= cpu:
        return None
    return (
        "OpenBLAS chose its %s kernels, but this CPU has %s: matrix products run several times slower than "
        "they could (OpenBLAS did not recognise the CPU, or was built without its kernels). Start Python "
        "with OPENBLAS_CORETYPE=%s in the "
        "environment (it is read when the library loads) to use them." % (core, _NAMES[cpu], _PIN[cpu])
    )


def check(stacklevel: int = 3) -> Optional[str]:
    """Warn (BlasWarning) when the engine's BLAS kernels are below this CPU's vector width.

    Nothing is checked when OPENBLAS_CORETYPE is set (the kernels were chosen).

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
        When the kernels are narrower than the CPU allows.
    """
    if "OPENBLAS_CORETYPE" in os.environ:
        return None
    text = advice(kernel(), cpu_flags())
    if text is not None:
        warnings.warn(text, BlasWarning, stacklevel=stacklevel)
    return text
