#!/usr/bin/env bash
# The larger pair of issue 29 (dcpythia-small / pythia-small: 6 layers, d_model 256, 8 heads,
# the bundled twins' recipe otherwise) trained on a machine with an NVIDIA GPU, in one command:
#
#     bash scripts/gpu_train_pair.sh [OUT_DIR] [SECONDS]     # default /tmp/gpu_pair, 600
#
# SECONDS is the whole command's time (a lent machine's call allows 600). The script
# 1. builds dclens with the CUDA backend (scripts/gpu_env.sh; DCLENS_DEBS / DCLENS_WHEELS there),
#    then 8 processes write the 160,000 training lines (synth_tasks corpus, seed 0: line i is
#    the same whatever the chunking; the generator reads the published file to leave its
#    examples out: ../shared/data, or PUBLISHED=PATH where ../shared does not travel);
# 2. probes: both twins side by side for 30 steps on the first 3,000 lines, timed as a whole;
# 3. sets the run's steps to what fits the time left (at most MAX_STEPS, default 6000) and trains
#    both twins side by side on the GPU (`train_bundled.py train --pair small --steps S`);
# 4. packs each twin's finished weights (float16, as shipped), loss.csv, train.log and run.json
#    into OUT_DIR/<twin>.tar (<twin>/final/..., <twin>/loss.csv, ...).
# Then, on any machine: `tar -C RUN -xf OUT_DIR/<twin>.tar` for both twins and
# `python scripts/train_bundled.py finish --pair small --out RUN` (benchmark, cards, the 60 MB
# check; --install bundles them).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-${OUT:-/tmp/gpu_pair}}
SECONDS_ALL=${2:-600}
MAX_STEPS=${MAX_STEPS:-6000}
MIN_STEPS=${MIN_STEPS:-300} # fewer: not worth a run (the warm-up alone is 150)
PROBE=${PROBE:-30}
RUN=${RUN:-/tmp/pair}
THREADS=${THREADS:-8}
mkdir -p "$OUT" "$RUN"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "=== [$(($(date +%s) - t0)) s] $*"; }

stamp machine
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
lscpu | grep -E "Model name|^CPU\(s\)"

if [ -z "${SKIP_BUILD:-}" ]; then # SKIP_BUILD=1 DEVICE=cpu: a dry run of the script on a CPU machine
  . scripts/gpu_env.sh || exit 1
fi
[ "${DEVICE:-cuda}" = cpu ] || python3 -c "import dclens, sys; sys.exit(0 if dclens.cuda_available() else 1)" || {
  echo "no CUDA: $(python3 -c 'import dclens; print(dclens.cuda_unavailable_reason())')"
  exit 1
}

stamp training lines, 8 chunks 
LINES=160000
CH=$((LINES / 8))
gen=()
if [ ! -s "$RUN/train.jsonl" ]; then
  for k in 0 1 2 3 4 5 6 7; do
    python3 -m synth_tasks.cli corpus train "$RUN/part$k.jsonl" --lines $CH --start $((k * CH)) \
      --seed 0 --format jsonl ${PUBLISHED:+--published "$PUBLISHED"} >/dev/null &
    gen+=($!)
  done
fi

[ ${#gen[@]} -eq 0 ] || wait "${gen[@]}" # (a bare `wait` would also wait for the tee above)
if [ ! -s "$RUN/train.jsonl" ]; then
  cat "$RUN"/part{0,1,2,3,4,5,6,7}.jsonl >"$RUN/train.jsonl" && rm -f "$RUN"/part*.jsonl
fi
[ "$(wc -l <"$RUN/train.jsonl")" -eq $LINES ] || { echo "training lines: expected $LINES"; exit 1; }

TB=(python3 scripts/train_bundled.py)
[ -n "${DEVICE:-}" ] && TB+=(--device "$DEVICE")
stamp "probe: $PROBE steps of each twin, side by side"
rm -rf /tmp/probe && mkdir -p /tmp/probe && head -3000 "$RUN/train.jsonl" >/tmp/probe/train.jsonl
p0=$(date +%s.%N)
"${TB[@]}" train --pair small --out /tmp/probe --steps 1000 --n-threads "$THREADS" --parallel --stop-after "$PROBE" || {
  tail -n 20 /tmp/probe/*.log
  exit 1
}
p1=$(date +%s.%N)
tail -n 2 /tmp/probe/*-small/train.log
# seconds a step: the larger of the wall time over the probe's steps (startup included) and the
# trainer's own figure at the probe's last logged step (its eta is (1000 - step) x the mean time
# of the 10 steps before it). The wall time is the one that holds: a twin that ends its probe
# first leaves the other alone on the GPU for its last steps, and alone a step ran 0.30 s where
# side by side it took 0.48 s (DCPythia, H200, 2026-11-26). Then the steps that fit the time left
# with 10% to spare, keeping 75 s for tokenizing the full file, loading and packing the results.
PER=$(python3 -c "
import re, glob
per = ($p1 - $p0) / $PROBE
for f in glob.glob('/tmp/probe/*-small/train.log'):
    m = re.findall(r'step (\d+)/1000 .* eta (\d+)s', open(f).read())
    if m:
        per = max(per, int(m[-1][1]) / (1000 - int(m[-1][0])))
print('%.4f' % per)
")
STEPS=$(python3 -c "
left = $SECONDS_ALL - ($(date +%s) - $t0) - 75
n = int(left / ($PER * 1.1))
print(max(0, min($MAX_STEPS, n // 100 * 100 or n)))
")
stamp "probe: $PER s a step (both twins at once; $(python3 -c "print('%.1f' % ($p1 - $p0))") s for the probe); run: $STEPS steps"
[ "$STEPS" -ge "$MIN_STEPS" ] || exit 1

stamp train
left=$((SECONDS_ALL - ($(date +%s) - t0) - 15))
timeout "$left" "${TB[@]}" train --pair small --out "$RUN" --steps "$STEPS" --n-threads "$THREADS" --parallel
echo "train exit $?"
stamp pack
P=/tmp/pack
for t in dcpythia-small pythia-small; do
  tail -n 3 "$RUN/$t/train.log"
  rm -rf "${P:?}/$t" && mkdir -p "$P/$t/final"
  cp "$RUN/$t/loss.csv" "$RUN/$t/train.log" "$RUN/$t/run.json" "$P/$t/"
  if [ -d "$RUN/$t/final" ]; then
    cp "$RUN/$t/final"/*.json "$P/$t/final/"
    python3 -c "
import sys
from safetensors.numpy import load_file, save_file
sd = load_file(sys.argv[1] + '/model.safetensors')
save_file({k: v.astype('float16') if v.dtype.kind == 'f' else v for k, v in sd.items()}, sys.argv[2] + '/model.safetensors')
" "$RUN/$t/final" "$P/$t/final"
  fi
  tar -C "$P" -cf "$OUT/$t.tar" "$t"
done
ls -la "$OUT"
stamp "all done"
