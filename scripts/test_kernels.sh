#!/usr/bin/env bash
# `make test-kernels`: the bit-identity and tolerance files again under two more
# kernels of the OpenBLAS dclens ships (scipy-openblas32), besides the one the
# main pytest run used (the CPU's own, or the environment's pin): the generic
# one (OPENBLAS_CORETYPE=Prescott; scipy-openblas32 runs its SSE "Katmai"
# kernels for it) and a vector kernel the CPU has that the main run did not use
# (SkylakeX on AVX-512, else Haswell on AVX2). The bits each path promises to
# share must not depend on the kernel: docs/tolerances.md, issue 48.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
files=(
  tests/passes/test_hooks.py tests/passes/test_tape_read.py tests/passes/test_tape_cache.py
  tests/passes/test_tape_stage.py tests/passes/test_variants.py tests/passes/test_golden.py
  tests/passes/test_fast_path.py tests/passes/test_attention_chunks.py tests/passes/test_parity.py
  tests/passes/test_decode.py tests/passes/test_grad.py tests/passes/test_grad_variants.py
  tests/passes/test_train.py tests/passes/test_partition.py tests/api/test_api.py
  tests/analyses/test_circuits.py tests/analyses/test_patching.py tests/analyses/test_attribution.py
  tests/analyses/test_analysis.py tests/analyses/test_graph.py
)
kernel() { $PY -c "import dclens; print(dclens.blas.kernel())"; }
own=$(kernel)
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
second=""
for f in avx512f avx512bw avx512vl avx512dq; do [[ " $flags " == *" $f "* ]] || { second=Haswell; break; }; done
[ -z "$second" ] && second=SkylakeX
[ "${own,,}" = "${second,,}" ] && second=Haswell
[[ " $flags " == *" avx2 "* ]] || second=""
for k in Prescott $second; do
  ran=$(OPENBLAS_CORETYPE=$k kernel)
  echo "test-kernels: OPENBLAS_CORETYPE=$k -> $($PY -c 'import dclens; print(dclens.blas.library())') kernel $ran (main run: $own)"
  OPENBLAS_CORETYPE=$k ./build/dev/test_kernels | tail -1
  OPENBLAS_CORETYPE=$k $PY -m pytest -q -p no:cacheprovider "${files[@]}"
done
