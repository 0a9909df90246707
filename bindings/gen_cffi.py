"""Write the C source of the cffi module dclens._engine (run by CMake).

    python bindings/gen_cffi.py OUT.c

The declarations are bindings/dclens/_cdef.py (one place); the module
includes the public header and is compiled and linked against the engine's
static libraries by CMakeLists.txt, so this script only generates C.
"""

import os
import sys

from cffi import FFI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dclens"))
from _cdef import CDEF  # noqa: E402


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: gen_cffi.py OUT.c")
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source("dclens._engine", '#include "dclens.h"\n')
    # write beside, then rename: an interrupted run leaves no half file
    tmp = argv[1] + ".tmp"
    ffi.emit_c_code(tmp)
    os.replace(tmp, argv[1])


if __name__ == "__main__":
    main(sys.argv)
