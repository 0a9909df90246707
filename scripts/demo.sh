#!/usr/bin/env bash
# The main job: run the 74-task synthetic benchmark side by side on the bundled
# trained twins, dcpythia-tiny (DCMHA) and pythia-tiny (its MHA twin: same size,
# data, token budget, schedule and seed), on the published file and on the
# held-out generated set, and draw attention heatmaps of the held-out line where
# the DCPythia's heads compose most. The twins ship with the package
# (bindings/dclens/models/, `dclens models`): nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-demo_out}
SHARED=${SHARED:-../shared}
DATA=$SHARED/data/synthetic_dataset.jsonl
LIMIT=${LIMIT:-}
[ -f "$DATA" ] || { echo "demo: $DATA not found (set SHARED=... to the folder holding data/)" >&2; exit 1; }

mkdir -p "$OUT/heatmaps"
DC=dcpythia-tiny; MHA=pythia-tiny
$PY -c "import dclens, sys; n = {m.name for m in dclens.bundled_models()}; sys.exit(0 if {'$DC', '$MHA'} <= n else 1)" || \
  { echo "demo: the bundled models $DC and $MHA are not installed (pip install -e .)" >&2; exit 1; }
echo "demo: the bundled trained twins $DC and $MHA"

$PY -m dclens.cli synth --model "$MHA" --model "$DC" --data "$DATA" \
    --out "$OUT/synth" ${LIMIT:+--limit $LIMIT}
$PY -m dclens.cli synth --model "$MHA" --model "$DC" --data heldout \
    --out "$OUT/synth_heldout" ${LIMIT:+--limit $LIMIT}

# the held-out line, layer and head where the DCPythia's composition changes attention most
$PY -m synth_tasks.cli composed-line --model "$DC" --data heldout --lines "${LIMIT:-74}" \
    --text-out "$OUT/heatmaps/line.txt" > "$OUT/heatmaps/line.json"
read -r LAYER HEAD < <($PY -c "import json, sys; p = json.load(open(sys.argv[1])); print(p['layer'], p['head'])" "$OUT/heatmaps/line.json")
TEXT=$(cat "$OUT/heatmaps/line.txt")
echo "demo: heatmaps of layer $LAYER head $HEAD on $OUT/heatmaps/line.txt ($OUT/heatmaps/line.json)"
$PY -m dclens.cli heatmap --model "$DC" --text "$TEXT" --layer "$LAYER" --hook pattern \
    --out "$OUT/heatmaps/L${LAYER}_pattern_all_heads.png"
$PY -m dclens.cli heatmap --model "$DC" --text "$TEXT" --layer "$LAYER" --hook pattern_composed \
    --out "$OUT/heatmaps/L${LAYER}_pattern_composed_all_heads.png"
$PY -m dclens.cli heatmap --model "$DC" --text "$TEXT" --layer "$LAYER" --head "$HEAD" --hook branches \
    --phase post --out "$OUT/heatmaps/L${LAYER}_H${HEAD}_post_branches.png"
$PY -m dclens.cli heatmap --model "$DC" --text "$TEXT" --layer all --head "$HEAD" --hook pattern_composed \
    --out "$OUT/heatmaps/H${HEAD}_across_layers.png"
$PY -m dclens.cli heatmap --model "$MHA" --text "$TEXT" --layer "$LAYER" --hook pattern \
    --out "$OUT/heatmaps/mha_L${LAYER}_pattern_all_heads.png"
echo "demo: reports in $OUT/synth (published) and $OUT/synth_heldout (held-out), heatmaps in $OUT/heatmaps"
