#!/usr/bin/env bash
# The main job: generate a small DCPythia and its Pythia twin (random weights,
# the published layouts, the real GPT-NeoX tokenizer), run the 74-task
# synthetic benchmark on both side by side, and draw attention heatmaps.
# Until trained models are bundled the accuracies are those of random models:
# the point is the whole pipeline, end to end. Point --model at a real
# checkpoint directory (e.g. DCPythia-6.9B) for real numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-demo_out}
SHARED=${SHARED:-../shared}
TOK=$SHARED/data/gpt-neox-20b-tokenizer.json
DATA=$SHARED/data/synthetic_dataset.jsonl
LIMIT=${LIMIT:-}
for f in "$TOK" "$DATA"; do
  [ -f "$f" ] || { echo "demo: $f not found (set SHARED=... to the folder holding data/)" >&2; exit 1; }
done

mkdir -p "$OUT/heatmaps"
common=(--n-layer 4 --dim 64 --n-head 8 --vocab 50304 --window-size 16 --tokenizer "$TOK" --seed 7)
[ -f "$OUT/tiny-dcpythia/config.json" ] || \
  $PY -m dcscope.testing.make_tiny "$OUT/tiny-dcpythia" --type dcpythia --dtype float16 --format torch "${common[@]}"
[ -f "$OUT/tiny-pythia/config.json" ] || \
  $PY -m dcscope.testing.make_tiny "$OUT/tiny-pythia" --type gpt_neox --dtype float16 --format safetensors "${common[@]}"

$PY -m dcscope.cli synth --model "$OUT/tiny-pythia" --model "$OUT/tiny-dcpythia" --data "$DATA" \
    --out "$OUT/synth" ${LIMIT:+--limit $LIMIT}

TEXT="When Mary and John went to the store, John gave a drink to"
$PY -m dcscope.cli heatmap --model "$OUT/tiny-dcpythia" --text "$TEXT" --layer 1 --hook pattern \
    --out "$OUT/heatmaps/L1_pattern_all_heads.png"
$PY -m dcscope.cli heatmap --model "$OUT/tiny-dcpythia" --text "$TEXT" --layer 1 --hook pattern_composed \
    --out "$OUT/heatmaps/L1_pattern_composed_all_heads.png"
$PY -m dcscope.cli heatmap --model "$OUT/tiny-dcpythia" --text "$TEXT" --layer 1 --head 3 --hook branches \
    --phase post --out "$OUT/heatmaps/L1_H3_post_branches.png"
$PY -m dcscope.cli heatmap --model "$OUT/tiny-dcpythia" --text "$TEXT" --layer all --head 0 --hook pattern \
    --out "$OUT/heatmaps/H0_across_layers.png"
echo "demo: report in $OUT/synth, heatmaps in $OUT/heatmaps"
