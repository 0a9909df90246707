"""dclens.blas: the OpenBLAS kernel the CPU backend runs, and the warning
when OpenBLAS fell back to kernels narrower than the CPU's (a virtual CPU it
does not recognise gets "Prescott")."""

import ctypes
import os
import subprocess
import sys
import warnings

import pytest

import dclens
from dclens import blas

AVX512 = {"sse3", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
AVX2 = {"sse3", "avx", "avx2", "fma"}


def _mapped_openblas():
    """The libopenblas this process has mapped (the engine's: numpy wheels
    bring their own, under another name), read from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "libopenblas" in os.path.basename(path) and "scipy" not in path and "numpy" not in path:
                return path
    return None


def test_kernel_is_what_the_engines_openblas_reports():
    k = blas.kernel()
    path = _mapped_openblas()
    if path is None:
        pytest.skip("no libopenblas mapped in this process")
    lib = ctypes.CDLL(path)
    lib.openblas_get_corename.restype = ctypes.c_char_p
    assert k and k == lib.openblas_get_corename().decode()


def test_kernel_follows_openblas_coretype():
    # the engine reports the kernel OpenBLAS actually chose, pin included
    env = dict(os.environ, OPENBLAS_CORETYPE="Prescott")
    out = subprocess.run(
        [sys.executable, "-c", "import dclens; print(dclens.blas.kernel())"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    assert out.lower() == "prescott"


@pytest.mark.parametrize(
    "core, flags, pin",
    [
        ("Prescott", AVX512, "SkylakeX"),
        ("Prescott", AVX2, "Haswell"),
        ("Core2", AVX2 - {"avx2", "fma"}, "Sandybridge"),
        ("Haswell", AVX512, "SkylakeX"),
        ("Sandybridge", AVX2, "Haswell"),
    ],
)
def test_advice_names_the_kernel_for_the_cpu(core, flags, pin):
    text = blas.advice(core, flags)
    assert text is not None and core in text and "OPENBLAS_CORETYPE=%s" % pin in text


@pytest.mark.parametrize(
    "core, flags",
    [
        ("Cooperlake", AVX512),
        ("SkylakeX", AVX512),
        ("Haswell", AVX2),
        ("Zen", AVX2),
        ("SkylakeX", AVX2),  # a kernel wider than the flags say: not ours to judge
        ("Prescott", {"sse3"}),  # an SSE3 CPU: Prescott is right
        ("SomethingNew", AVX512),  # a kernel name it does not know: no false alarm
        ("", AVX512),  # a BLAS that cannot say
        ("Prescott", set()),  # no /proc/cpuinfo
    ],
)
def test_no_advice_where_the_kernels_fit(core, flags):
    assert blas.advice(core, flags) is None


def test_cpu_flags_reads_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse3 avx2 fma\n\nprocessor\t: 1\nflags\t: other\n")
    assert blas.cpu_flags(str(f)) == {"fpu", "sse3", "avx2", "fma"}
    assert blas.cpu_flags(str(tmp_path / "missing")) == set()


def test_load_warns_once_per_call_site_on_a_fallback(monkeypatch, tiny_factory):
    d = tiny_factory()[0]
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(blas, "kernel", lambda: "Prescott")
    monkeypatch.setattr(blas, "cpu_flags", lambda path="/proc/cpuinfo": set(AVX512))
    with pytest.warns(dclens.BlasWarning, match="OPENBLAS_CORETYPE=SkylakeX") as rec:
        dclens.load(d)
    assert rec[0].filename == __file__  # points at the caller's line
    # a pin is the user's choice: no warning
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Prescott")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dclens.load(d)


def test_no_warning_where_the_kernels_fit(monkeypatch, tiny_factory):
    d = tiny_factory()[0]
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(blas, "kernel", lambda: "Cooperlake")
    monkeypatch.setattr(blas, "cpu_flags", lambda path="/proc/cpuinfo": set(AVX512))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dclens.load(d)
