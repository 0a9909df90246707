"""cffi build of the dcscope engine: compiles engine/src/*.c (and, when nvcc
is available, the CUDA backend) into the extension module dcscope._engine.

Set DCSCOPE_CUDA=0 to build without CUDA, DCSCOPE_CUDA=1 to require it.

Sanitizer build (used by `make asan-py`; never by pip): DCSCOPE_SANITIZE=1
compiles with AddressSanitizer + UBSan and without CUDA, and
`DCSCOPE_SANITIZE=1 DCSCOPE_BUILD_DIR=DIR python bindings/build_engine.py`
(run from the repository root) writes DIR/dcscope/_engine*.so there,
leaving the installed extension alone.
"""
import glob
import os
import shutil
import subprocess
import sys

from cffi import FFI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "engine")
sys.path.insert(0, os.path.join(ROOT, "bindings", "dcscope"))
from _cdef import CDEF  # noqa: E402  (the C declarations, one place)


def pkg_flags(name, kind):
    try:
        out = subprocess.run(["pkg-config", kind, name], capture_output=True, text=True, check=True).stdout
        return out.split()
    except (OSError, subprocess.CalledProcessError):
        return []


SANITIZE = os.environ.get("DCSCOPE_SANITIZE", "0") not in ("", "0")
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]


def cuda_object():
    """Compile the CUDA backend with nvcc; returns (objects, libs, lib_dirs, macros)."""
    want = os.environ.get("DCSCOPE_CUDA", "auto")
    if SANITIZE:
        want = "0"  # the CUDA runtime and ASan's shadow memory do not mix
    src = os.path.join(ENGINE, "src", "cuda", "backend_cuda.cu")
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if want == "0" or not os.path.exists(src) or not nvcc:
        if want == "1":
            raise RuntimeError("DCSCOPE_CUDA=1 but nvcc or %s is missing" % src)
        return [], [], [], []
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    out_dir = os.path.join(ROOT, "build", "cuda")
    os.makedirs(out_dir, exist_ok=True)
    obj = os.path.join(out_dir, "backend_cuda.o")
    cmd = ["make", "-s", "-C", ENGINE, "-f", "cuda.mk", "NVCC=" + nvcc, "CUDA_HOME=" + cuda_home,
           "BUILD=" + out_dir, obj]
    subprocess.run(cmd, check=True)
    lib64 = os.path.join(cuda_home, "lib64")
    return [obj], ["cudart", "cublas"], [lib64], [("DCS_WITH_CUDA", "1")]


objs, cuda_libs, cuda_dirs, cuda_macros = cuda_object()
blas_inc = [f[2:] for f in pkg_flags("openblas", "--cflags") if f.startswith("-I")]
blas_dirs = [f[2:] for f in pkg_flags("openblas", "--libs") if f.startswith("-L")]


def src_path(p):
    # setuptools wants paths relative to setup.py (the repository root); run as
    # a script, cffi compiles inside DCSCOPE_BUILD_DIR, so absolute ones then
    return p if __name__ == "__main__" else os.path.relpath(p, ROOT)


ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "dcscope._engine",
    '#include "dcscope.h"\n',
    sources=sorted(src_path(p) for p in glob.glob(os.path.join(ENGINE, "src", "*.c"))),
    include_dirs=[src_path(os.path.join(ENGINE, "include")), src_path(os.path.join(ENGINE, "src"))] + blas_inc,
    libraries=["openblas", "png", "z", "cjson", "m", "pthread"] + cuda_libs,
    library_dirs=blas_dirs + cuda_dirs,
    runtime_library_dirs=blas_dirs + cuda_dirs,
    extra_objects=[src_path(o) for o in objs],
    define_macros=[("_POSIX_C_SOURCE", "200809L"), ("_DEFAULT_SOURCE", "1")] + cuda_macros,
    extra_compile_args=["-std=c11", "-Wall", "-Wno-unused-function"]
    + (["-O1", "-g"] + SAN_FLAGS if SANITIZE else ["-O2"]),
    extra_link_args=SAN_FLAGS if SANITIZE else [],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=os.environ.get("DCSCOPE_BUILD_DIR", "."), verbose=True)
