#!/usr/bin/env bash
# The checks and benchmarks of a machine with an NVIDIA GPU, in one command of under 8 minutes
# (issue 39; docs/cuda.md "Checking a GPU", docs/benchmarks/diary.md's "lent GPU machine" sections):
#
#     bash scripts/gpu_check.sh [OUT_DIR]            # default /tmp/gpu_check
#
# 1. builds dclens with the CUDA backend (pip install -e ., CUDA_ARCH default 90-real),
# 2. the C tests (ctest --preset dev), then test_cuda and test_backend_bw again with
#    DCLENS_CUDA_KERNELS=new (the warp-per-row kernels and pinned staging, not yet the default),
# 3. the GPU pytest files: CUDA forward, backward, tapes, fork and error paths, the 16-bit weights
#    and the new kernels with gradients (tests/gpu/test_cuda_16bit.py), attention by query chunks
#    (tests/gpu/test_cuda_chunks.py); test_cuda.py and the chunks again with the
#    new kernels,
# 4. gradients + 16-step IG on a 4-layer DCPythia-6.9B-shaped checkpoint, bfloat16 weights and the
#    new kernels, against a same-run bf16 cuBLAS GEMM of the layer's shapes (scripts/bench_grad.py),
# 5. scripts/bench_cuda.py --variants: the CUDA paths against each other (float32 with the verified
#    and the new kernels, float16 and bfloat16 weights): tokens/s, capture-all / plain, a gradient
#    step, logit differences; scripts/bench_attention_chunks.py: attention by query chunks against
#    the full path (seconds, activation peak); then scripts/bench_cuda_vs_official.py: the official DCPythia module against dclens on the same
#    random DCPythia-6.9B-shaped bf16 checkpoint, same GPU, same tokens (prefill tokens/s, peak
#    memory, logits difference, a gradient step, IG), when .gpu_carry/ holds the module,
# 6. with FULL=1 only: the older issues' CPU measurements (1-16 threads, issue 28; training vs
#    PyTorch, issue 29), which take several minutes more.
#
# Each step has its own time limit; the log and the JSON/XML results go to OUT_DIR.
# A lent machine has no network: what it lacks travels in the git-ignored folder .gpu_carry/
# (device `carry`), made here with `bash scripts/gpu_carry.sh`: Debian packages of OpenBLAS,
# libpng and cJSON (DCLENS_DEBS=.gpu_carry/debs unpacks them into /tmp/deps and builds against
# them), the cffi/pycparser wheels (DCLENS_WHEELS=.gpu_carry/dclens_whl), and for step 5 the
# official module (.gpu_carry/DCFormer) and the transformers version it needs (.gpu_carry/whl).
set -u
cd "$(dirname "$0")/.." || exit 1
[ -d .gpu_carry/debs ] && : "${DCLENS_DEBS:=$PWD/.gpu_carry/debs}" && export DCLENS_DEBS
[ -d .gpu_carry/dclens_whl ] && : "${DCLENS_WHEELS:=$PWD/.gpu_carry/dclens_whl}" && export DCLENS_WHEELS
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
stamp C kernel tests, DCLENS_CUDA_KERNELS=new
DCLENS_CUDA_KERNELS=new timeout 120 ./build/dev/test_cuda >"$OUT/test_cuda_new.txt" 2>&1
grep -E "FAIL|cuda:" "$OUT/test_cuda_new.txt" | tail -8
DCLENS_CUDA_KERNELS=new timeout 120 ./build/dev/test_backend_bw >"$OUT/test_backend_bw_new.txt" 2>&1
grep -E "FAIL|passed" "$OUT/test_backend_bw_new.txt" | tail -8

stamp GPU pytest files
X=""
python3 -c "import xdist" 2>/dev/null && X="-n 4"
# shellcheck disable=SC2086
timeout 180 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider $X --junitxml="$OUT/pytest.xml" \
  tests/gpu/test_cuda.py tests/gpu/test_cuda_grad.py tests/gpu/test_cuda_16bit.py tests/gpu/test_cuda_chunks.py \
  tests/passes/test_tape_cache.py \
  tests/passes/test_fork.py tests/api/test_errors.py >"$OUT/pytest.txt" 2>&1
echo "pytest exit $?"
grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -30
stamp GPU pytest, DCLENS_CUDA_KERNELS=new
# shellcheck disable=SC2086
DCLENS_CUDA_KERNELS=new timeout 150 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider $X \
  --junitxml="$OUT/pytest_new.xml" tests/gpu/test_cuda.py tests/gpu/test_cuda_chunks.py >"$OUT/pytest_new.txt" 2>&1
echo "pytest (new kernels) exit $?"
grep -E "passed|failed|error" "$OUT/pytest_new.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest_new.txt" | head -30

stamp "IG on a 4-layer DCPythia-6.9B-shaped fp16 checkpoint, CUDA, bfloat16 weights, new kernels"
# (float32 weights, verified kernels: 0.169 s per IG step, BENCHMARKS.md 2026-11-26)
DCLENS_CUDA_KERNELS=new timeout 100 python3 scripts/bench_grad.py /tmp/g69 --device cuda --layers 4 --T 128 \
  --steps 16 --max-tape-gib 0 --dtype bfloat16 >"$OUT/grad4_bf16.txt" 2>&1
tail -6 "$OUT/grad4_bf16.txt"

stamp "CUDA paths against each other: fp32 verified / fp32 new kernels / fp16 / bf16 (DCPythia-6.9B widths, 4 layers)"
timeout 150 python3 scripts/bench_cuda.py --variants --dim 4096 --heads 32 --layers 4 --vocab 50432 --T 128 512 \
  --repeat 1 2>&1 | tail -10

stamp "attention by query chunks vs the full path, CUDA bf16, DCPythia-6.9B widths (2 layers), T 2048"
# seconds and activation peak per attention_rows (-1 full, 0 auto = 256 rows here, 64, 128); picks the default
timeout 120 python3 scripts/bench_attention_chunks.py --device cuda --variant dcpythia --dtype bfloat16 --dim 4096 \
  --heads 32 --ff 16384 --layers 2 --vocab 8192 --B 1 --T 2048 --rows 0 64 128 --repeat 3 \
  --json "$OUT/chunks.json" 2>&1 | tail -7

if [ -d .gpu_carry/DCFormer ]; then
  stamp official DCPythia module vs dclens, same GPU
  # the official module also under (regional) torch.compile, last, in what is left of the budget;
  # NO_COMPILE=1 skips it
  C=""
  [ "${NO_COMPILE:-0}" = 1 ] && C="--no-compile"
  # shellcheck disable=SC2086
  timeout 280 python3 scripts/bench_cuda_vs_official.py --module .gpu_carry/DCFormer/pytorch/dcpythia \
    --wheels .gpu_carry/whl --budget-s 240 $C --out "$OUT/official.json" >"$OUT/official.txt" 2>&1
  echo "bench_cuda_vs_official exit $?"
  tail -30 "$OUT/official.txt"
else
  stamp "no .gpu_carry/DCFormer: the comparison with the official module skipped (bash scripts/gpu_carry.sh)"
fi

if [ "${FULL:-0}" = 1 ]; then
  stamp CPU forward, 1-16 threads, unpinned
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE DCLENS_BENCH_TMP=/tmp timeout 240 python3 scripts/bench.py \
    --sizes d1024,1.4b --T 512 --no-extras --scaling 1,2,4,8,16 --repeat 2 --out "$OUT/scaling.json" 2>&1 | tail -28
  stamp CUDA vs CPU forward
  timeout 90 python3 scripts/bench_cuda.py --T 512 2048 2>&1 | tail -8
  stamp training vs PyTorch, 2 cores
  timeout 90 taskset -c 0,1 python3 scripts/bench_train.py --vs-torch --torch-python "$(command -v python3)" 2>&1 | tail -8
fi
stamp "all done"
