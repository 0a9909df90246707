#!/bin/sh
# Build the input-parser fuzzers and run each one for a while.
#
#   engine/fuzz/run.sh [SECONDS]        (default 30 seconds per target)
#
# Targets (docs/fuzzing.md has the long campaigns, parallel jobs, crashes):
#   fuzz_safetensors  safetensors header + tensor table      (libFuzzer, C)
#   fuzz_torchzip     torch zip reader + restricted unpickler (libFuzzer, C)
#   fuzz_config       config.json handling (dcs_parse_config) (libFuzzer, C)
#   fuzz_index        *.index.json weight_map (dcs_parse_index_json)
#   fuzz_jsonl        synth_tasks JSONL loader                (atheris, Python)
# The C targets are built with clang -fsanitize=fuzzer,address,undefined by
# CMake (the "fuzz" preset: the dclens_io library and engine/fuzz/fuzz_*.c).
# Needs clang (14 or later) with its runtime, cJSON, and for fuzz_jsonl the
# atheris module (pip install atheris; skipped, and said so, without it).
#
# Seeds: engine/fuzz/corpus/<name>/ (made by make_corpus.py if missing).
# Output under engine/build/fuzz/ (the preset's build directory): the binaries, corpus_<name>/ (new inputs,
# kept between runs), <name>.log (the whole libFuzzer output, shown when a
# target fails or with FUZZ_VERBOSE=1) and <name>-crash-*/-leak-*/-timeout-*
# (the failing inputs; the command to reproduce one is printed).
# Environment: CC (clang), PY (python3), FUZZ_VERBOSE=1, FUZZ_TARGETS="config index"
# (a subset, by name).
set -eu

secs=${1:-30}
here=$(cd "$(dirname "$0")" && pwd)
engine=$(dirname "$here")
out=$engine/build/fuzz
CC=${CC:-clang}
PY=${PY:-python3}
targets=${FUZZ_TARGETS:-"safetensors torchzip config index jsonl"}
mkdir -p "$out"
for t in $targets; do
    if [ ! -d "$here/corpus/$t" ]; then
        "$PY" "$here/make_corpus.py" "$here/corpus"
        break
    fi
done

# the C targets: CMake's "fuzz" preset (CMakePresets.json) builds the io
# layer with coverage + sanitizers into $out and links each target to it
case " $targets " in *" safetensors "*|*" torchzip "*|*" config "*|*" index "*)
    echo "== building the fuzz targets with $CC (cmake --preset fuzz)"
    root=$(dirname "$engine")
    if ! (cd "$root" && cmake --preset fuzz -DCMAKE_C_COMPILER="$CC" --log-level=WARNING >"$out/cmake.log" 2>&1 &&
          cmake --build --preset fuzz >>"$out/cmake.log" 2>&1); then
        tail -n 40 "$out/cmake.log" >&2
        echo "run.sh: building the fuzz targets failed (log: $out/cmake.log)" >&2
        exit 1
    fi
    ;;
esac

status=0
summary=""
ran=0
failed=0
skipped=0

# stat NAME LOG: one summary line from libFuzzer's -print_final_stats output
stat() {
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$2" | tail -n 1)
    eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$2" | tail -n 1)
    new=$(sed -n 's/^stat::new_units_added: *//p' "$2" | tail -n 1)
    corp=$(sed -n 's/^#[0-9]*[[:space:]]*DONE .* corp: \([0-9]*\)\/.*/\1/p' "$2" | tail -n 1)
    cov=$(sed -n 's/^#[0-9]*[[:space:]]*DONE *cov: \([0-9]*\) .*/\1/p' "$2" | tail -n 1)
    printf '  %-17s %-7s %9s runs %7s/s  cov %5s  corpus %5s (+%s new)\n' "fuzz_$1" "$3" \
        "${runs:-?}" "${eps:-?}" "${cov:-?}" "${corp:-?}" "${new:-?}"
}

for t in $targets; do
    log=$out/$t.log
    corpus=$out/corpus_$t
    mkdir -p "$corpus"
    case $t in
    jsonl)
        if ! "$PY" -c "import atheris" 2>/dev/null; then
            echo "== fuzz_jsonl SKIPPED: atheris is not installed for $PY (pip install atheris)"
            summary="$summary$(printf '  %-17s SKIPPED (atheris not installed for %s)' fuzz_jsonl "$PY")
"
            skipped=$((skipped + 1))
            continue
        fi
        set -- "$PY" "$here/fuzz_jsonl.py"
        maxlen=16384
        export FUZZ_JSONL_FILE="$out/jsonl_input.jsonl"
        ;;
    safetensors|torchzip|config|index)
        set -- "$out/fuzz_$t"
        maxlen=65536
        ;;
    *)
        echo "run.sh: unknown target '$t' (known: safetensors torchzip config index jsonl)" >&2
        exit 2
        ;;
    esac
    echo "== fuzz_$t for ${secs}s (log: $log)"
    ran=$((ran + 1))
    rc=0
    if [ "${FUZZ_VERBOSE:-0}" = 1 ]; then
        ASAN_OPTIONS=detect_leaks=1 "$@" -max_total_time="$secs" -max_len=$maxlen \
            -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -dict="$here/$t.dict" \
            -artifact_prefix="$out/$t-" "$corpus" "$here/corpus/$t" 2>&1 | tee "$log" || rc=1
        grep -q '^Done [0-9]* runs' "$log" || rc=1     # tee hides the fuzzer's status
    else
        ASAN_OPTIONS=detect_leaks=1 "$@" -max_total_time="$secs" -max_len=$maxlen \
            -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -dict="$here/$t.dict" \
            -artifact_prefix="$out/$t-" "$corpus" "$here/corpus/$t" >"$log" 2>&1 || rc=$?
    fi
    if [ "$rc" -eq 0 ]; then
        summary="$summary$(stat "$t" "$log" ok)
"
    else
        [ "${FUZZ_VERBOSE:-0}" = 1 ] || tail -n 60 "$log" >&2
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
        echo "fuzz_$t FAILED (exit $rc): reproduce with" >&2
        if [ "$t" = jsonl ]; then
            echo "  $PY $here/fuzz_jsonl.py ${artifact:-$out/$t-crash-...}" >&2
        else
            echo "  $out/fuzz_$t ${artifact:-$out/$t-crash-...}" >&2
        fi
        summary="$summary$(stat "$t" "$log" FAILED)
"
        failed=$((failed + 1))
        status=1
    fi
done

echo "== fuzz summary: ${secs}s per target; logs, corpora and crashes under $out/"
printf '%s' "$summary"
echo "fuzz: $ran target(s) ran, $failed failed, $skipped skipped"
exit $status
