"""cffi build of the dcscope engine: compiles engine/src/*.c (and, when nvcc
is available, the CUDA backend) into the extension module dcscope._engine.

Set DCSCOPE_CUDA=0 to build without CUDA, DCSCOPE_CUDA=1 to require it.
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


def cuda_object():
    """Compile the CUDA backend with nvcc; returns (objects, libs, lib_dirs, macros)."""
    want = os.environ.get("DCSCOPE_CUDA", "auto")
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

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "dcscope._engine",
    '#include "dcscope.h"\n',
    # setuptools wants paths relative to setup.py (the repository root)
    sources=sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ENGINE, "src", "*.c"))),
    include_dirs=["engine/include", "engine/src"] + blas_inc,
    libraries=["openblas", "png", "z", "cjson", "m"] + cuda_libs,
    library_dirs=blas_dirs + cuda_dirs,
    runtime_library_dirs=blas_dirs + cuda_dirs,
    extra_objects=[os.path.relpath(o, ROOT) for o in objs],
    define_macros=[("_POSIX_C_SOURCE", "200809L"), ("_DEFAULT_SOURCE", "1")] + cuda_macros,
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
