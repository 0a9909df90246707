#!/usr/bin/env bash
# A/B forward time of two dclens builds at 1 and 2 threads, alternating processes
# (docs/benchmarks/diary.md, "GEMM blocks cut by shape"). OLD_PY / NEW_PY: python executables whose
# dclens is each build (e.g. two venvs with `make build` in two worktrees); MODEL: a
# checkpoint, e.g. `dclens make-tiny /tmp/d1024 --n-layer 2 --dim 1024 --n-head 16 --vocab 2048
# --intermediate 4096 --window-size null`. Pauses a running `dclens train` while it measures;
# the OpenBLAS pin is removed for the measurement only. Environment: THREADS (default "2 1"),
# TS (sequence lengths, default "512 2048"), CLOCK=process_time to time the process's CPU
# seconds instead of wall (less disturbed by other jobs on shared cores).
#   bash scripts/ab_threads.sh OLD_PY NEW_PY MODEL [ROUNDS]
set -u
old=$1 new=$2 model=$3 rounds=${4:-3}
pkill -STOP -f "dclens.cli train"; trap 'pkill -CONT -f "dclens.cli train"' EXIT
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
code='
import sys, time, numpy as np, dclens
m = dclens.load(sys.argv[1], n_threads=int(sys.argv[3]))
t = np.random.default_rng(0).integers(0, m.config.vocab, (int(sys.argv[2]),))
clock = getattr(time, sys.argv[4])
m.forward(t); best = 1e9
for _ in range(5):
    a = clock(); m.forward(t); best = min(best, clock() - a)
print("%.4f" % best)'
clock=${CLOCK:-perf_counter}
for th in ${THREADS:-2 1}; do for T in ${TS:-512 2048}; do for r in $(seq "$rounds"); do
  echo "threads=$th T=$T old=$("$old" -c "$code" "$model" "$T" "$th" "$clock") new=$("$new" -c "$code" "$model" "$T" "$th" "$clock")"
done; done; done
