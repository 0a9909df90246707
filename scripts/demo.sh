#!/usr/bin/env bash
# The main job: run the 74-task synthetic benchmark side by side on a small
# DCPythia and its Pythia twin, on the published file and on the held-out
# generated set, and draw attention heatmaps of the benchmark line where the
# DCPythia's heads compose most. The twins are the bundled trained models
# (dcpythia-tiny, pythia-tiny: `dcscope models`) when both are installed;
# until then generated ones (random weights, the published layouts, the real
# GPT-NeoX tokenizer), whose accuracies are those of random models: the point
# is then the whole pipeline, end to end.
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
if $PY -c "import dcscope, sys; n = {m.name for m in dcscope.bundled_models()}; sys.exit(0 if {'dcpythia-tiny', 'pythia-tiny'} <= n else 1)"; then
  DC=dcpythia-tiny; MHA=pythia-tiny
  echo "demo: the bundled trained twins $DC and $MHA"
else
  common=(--n-layer 4 --dim 64 --n-head 8 --vocab 50304 --window-size 16 --tokenizer "$TOK" --seed 7)
  [ -f "$OUT/tiny-dcpythia/config.json" ] || \
    $PY -m dcscope.testing.make_tiny "$OUT/tiny-dcpythia" --type dcpythia --dtype float16 --format torch "${common[@]}"
  [ -f "$OUT/tiny-pythia/config.json" ] || \
    $PY -m dcscope.testing.make_tiny "$OUT/tiny-pythia" --type gpt_neox --dtype float16 --format safetensors "${common[@]}"
  DC="$OUT/tiny-dcpythia"; MHA="$OUT/tiny-pythia"
  echo "demo: no bundled twins installed: generated random twins in $OUT"
fi

$PY -m dcscope.cli synth --model "$MHA" --model "$DC" --data "$DATA" \
    --out "$OUT/synth" ${LIMIT:+--limit $LIMIT}
$PY -m dcscope.cli synth --model "$MHA" --model "$DC" --data heldout \
    --out "$OUT/synth_heldout" ${LIMIT:+--limit $LIMIT}

# the held-out line, layer and head where the DCPythia's composition changes attention most
$PY -m synth_tasks.cli composed-line --model "$DC" --data heldout --lines "${LIMIT:-74}" \
    --text-out "$OUT/heatmaps/line.txt" > "$OUT/heatmaps/line.json"
read -r LAYER HEAD < <($PY -c "import json, sys; p = json.load(open(sys.argv[1])); print(p['layer'], p['head'])" "$OUT/heatmaps/line.json")
TEXT=$(cat "$OUT/heatmaps/line.txt")
echo "demo: heatmaps of layer $LAYER head $HEAD on $OUT/heatmaps/line.txt ($OUT/heatmaps/line.json)"
$PY -m dcscope.cli heatmap --model "$DC" --text "$TEXT" --layer "$LAYER" --hook pattern \
    --out "$OUT/heatmaps/L${LAYER}_pattern_all_heads.png"
$PY -m dcscope.cli heatmap --model "$DC" --text "$TEXT" --layer "$LAYER" --hook pattern_composed \
    --out "$OUT/heatmaps/L${LAYER}_pattern_composed_all_heads.png"
$PY -m dcscope.cli heatmap --model "$DC" --text "$TEXT" --layer "$LAYER" --head "$HEAD" --hook branches \
    --phase post --out "$OUT/heatmaps/L${LAYER}_H${HEAD}_post_branches.png"
$PY -m dcscope.cli heatmap --model "$DC" --text "$TEXT" --layer all --head "$HEAD" --hook pattern_composed \
    --out "$OUT/heatmaps/H${HEAD}_across_layers.png"
$PY -m dcscope.cli heatmap --model "$MHA" --text "$TEXT" --layer "$LAYER" --hook pattern \
    --out "$OUT/heatmaps/mha_L${LAYER}_pattern_all_heads.png"
echo "demo: reports in $OUT/synth (published) and $OUT/synth_heldout (held-out), heatmaps in $OUT/heatmaps"
