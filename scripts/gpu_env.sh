# Sourced by the GPU machine's scripts (scripts/gpu_check.sh, scripts/gpu_train_pair.sh): the
# set-up a bare lent machine needs, then dclens built with the CUDA backend (pip install -e .,
# CUDA_ARCH default 90-real). Needs `stamp` and sets CMAKE_ARGS for later cmake calls.
# A machine without libpng / cJSON headers: DCLENS_DEBS=DIR unpacks the Debian packages (.deb)
# in DIR into /tmp/deps and builds against them; DCLENS_WHEELS=DIR puts the wheels in DIR
# (cffi, pycparser, scipy-openblas32: the engine's BLAS, found by CMake there) on PYTHONPATH. (The project's lent GPU machines needed both.)
# shellcheck shell=bash
stamp set-up
ARGS="-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90-real} -DDCLENS_CUDA=ON"
if [ -n "${DCLENS_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$DCLENS_WHEELS"/*.whl || return 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "${DCLENS_DEBS:-}" ]; then
  mkdir -p /tmp/deps
  for f in "$DCLENS_DEBS"/*.deb; do dpkg -x "$f" /tmp/deps; done
  D=/tmp/deps/usr
  L=$D/lib/x86_64-linux-gnu
  ZL=/usr/lib/x86_64-linux-gnu/libz.so.1
  [ -e "$ZL" ] || ZL=/lib/x86_64-linux-gnu/libz.so.1
  export LD_LIBRARY_PATH=$L${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CFLAGS="-I$D/include"
  ARGS="$ARGS -DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON"
  ARGS="$ARGS -DPNG_LIBRARY=$L/libpng16.so -DPNG_PNG_INCLUDE_DIR=$D/include -DZLIB_LIBRARY=$ZL -DZLIB_INCLUDE_DIR=$D/include"
  ARGS="$ARGS -DCJSON_LIBRARY=$L/libcjson.so -DCJSON_INCLUDE_DIR=$D/include"
fi
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL

stamp build
timeout 300 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -20
python3 -c "import dclens; print('dclens', dclens.__file__, '| cuda:', dclens.cuda_available(), dclens.cuda_unavailable_reason())" || return 1

