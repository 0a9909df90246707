#!/usr/bin/env bash
# The checks and benchmarks of a machine with an NVIDIA GPU, in one command
# (what docs/benchmarks/diary.md's "lent GPU machine" sections and docs/cuda.md report):
#
#     bash scripts/gpu_check.sh [OUT_DIR]            # default /tmp/gpu_check
#
# 1. builds dclens with the CUDA backend (pip install -e ., CUDA_ARCH default 90-real),
# 2. the C tests (ctest --preset dev; test_cuda runs every kernel against the CPU backend),
# 3. the GPU pytest files (CUDA forward, backward, tapes, fork and error paths),
# 4. gradients + 16-step IG on a DCPythia-6.9B-shaped fp16 checkpoint on CUDA, 4 and 32 layers
#    (scripts/bench_grad.py --device cuda; writes 2.5 + 13.9 GB under /tmp),
# 5. the CPU forward from 1 to 16 threads at D=1024 and the 1.4B shape (issue 28), unpinned, and
#    again with OPENBLAS_CORETYPE=SkylakeX on an AVX-512 CPU (an OpenBLAS that does not recognise
#    a virtual CPU falls back to its Prescott kernels: the script says which kernel ran),
# 6. the CUDA vs CPU forward (scripts/bench_cuda.py), 7. training vs PyTorch on 2 cores.
#
# Each step has its own time limit; the log and the JSON/XML results go to OUT_DIR.
# A machine without OpenBLAS / libpng / cJSON headers: DCLENS_DEBS=DIR unpacks the Debian
# packages (.deb) in DIR into /tmp/deps and builds against them; DCLENS_WHEELS=DIR puts the
# wheels in DIR (cffi, pycparser) on PYTHONPATH. (The project's lent GPU machines needed both.)
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "=== [$(($(date +%s) - t0)) s] $*"; }

stamp machine
nproc
lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\)|Core\(s\)|Socket|L2|L3"
lscpu | grep -o 'avx512[a-z_]*' | sort -u | tr '\n' ' '
echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 --version
nvcc --version | tail -1

. scripts/gpu_env.sh || exit 1

stamp C tests
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of -D options
cmake --preset dev $CMAKE_ARGS -DPython3_EXECUTABLE="$(command -v python3)" --log-level=WARNING >/dev/null &&
  cmake --build --preset dev >/dev/null &&
  timeout 120 ctest --preset dev -j8 >"$OUT/ctest.txt" 2>&1
tail -4 "$OUT/ctest.txt"
./build/dev/test_cuda 2>&1 | tail -5

stamp GPU pytest files
X=""
python3 -c "import xdist" 2>/dev/null && X="-n 4"
# shellcheck disable=SC2086
timeout 180 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider $X --junitxml="$OUT/pytest.xml" \
  tests/gpu/test_cuda.py tests/gpu/test_cuda_grad.py tests/engine/test_tape_cache.py tests/engine/test_fork.py tests/api/test_errors.py \
  >"$OUT/pytest.txt" 2>&1
echo "pytest exit $?"
grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -30

stamp IG on a DCPythia-6.9B-shaped fp16 checkpoint, CUDA
timeout 100 python3 scripts/bench_grad.py /tmp/g69 --device cuda --layers 4 --T 128 --steps 16 --max-tape-gib 0 >"$OUT/grad4.txt" 2>&1
tail -6 "$OUT/grad4.txt"
timeout 150 python3 scripts/bench_grad.py /tmp/g69full --device cuda --layers 32 --T 128 --steps 16 --max-tape-gib 0 >"$OUT/grad32.txt" 2>&1
tail -6 "$OUT/grad32.txt"

stamp CPU forward, 1-16 threads, unpinned
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE DCLENS_BENCH_TMP=/tmp timeout 240 python3 scripts/bench.py \
  --sizes d1024,1.4b --T 512 --no-extras --scaling 1,2,4,8,16 --repeat 2 --out "$OUT/scaling.json" 2>&1 | tail -28
if lscpu | grep -q avx512f; then
  stamp CPU forward, 1-16 threads, OPENBLAS_CORETYPE=SkylakeX
  OPENBLAS_CORETYPE=SkylakeX DCLENS_BENCH_TMP=/tmp timeout 180 python3 scripts/bench.py \
    --sizes d1024,1.4b --T 512 --no-extras --scaling 1,2,4,8,16 --repeat 2 --out "$OUT/scaling_skx.json" 2>&1 | tail -28
fi

stamp CUDA vs CPU forward
timeout 90 python3 scripts/bench_cuda.py --T 512 2048 2>&1 | tail -8

stamp training vs PyTorch, 2 cores
timeout 90 taskset -c 0,1 python3 scripts/bench_train.py --vs-torch --torch-python "$(command -v python3)" 2>&1 | tail -8
stamp "all done"
