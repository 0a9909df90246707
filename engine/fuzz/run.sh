#!/bin/sh
# Build the loader fuzzers with libFuzzer + ASan + UBSan and run each one.
#
#   engine/fuzz/run.sh [SECONDS]        (default 30 seconds per target)
#
# Needs clang (14 or later) with its runtime (libclang-rt-*-dev) and cJSON.
# Seeds: engine/fuzz/corpus/<target>/ (made by make_corpus.py if missing);
# new inputs go to engine/build/fuzz/corpus_<target>/, crashes to
# engine/build/fuzz/crash-* (the command to reproduce one is printed).
set -eu

secs=${1:-30}
here=$(cd "$(dirname "$0")" && pwd)
engine=$(dirname "$here")
out=$engine/build/fuzz
CC=${CC:-clang}
CFLAGS="-std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
 -fno-omit-frame-pointer -I$engine/include -I$engine/src"
SRCS="error.c files.c tensors.c load_safetensors.c load_torchzip.c"

mkdir -p "$out"
if [ ! -d "$here/corpus/safetensors" ] || [ ! -d "$here/corpus/torchzip" ]; then
    python3 "$here/make_corpus.py" "$here/corpus"
fi

status=0
for target in safetensors torchzip; do
    srcs=""
    for s in $SRCS; do srcs="$srcs $engine/src/$s"; done
    # shellcheck disable=SC2086  # word splitting of the flag and source lists is wanted
    $CC $CFLAGS "$here/fuzz_$target.c" $srcs -lcjson -lm -o "$out/fuzz_$target"
    mkdir -p "$out/corpus_$target"
    echo "== fuzz_$target for ${secs}s"
    if ! ASAN_OPTIONS=detect_leaks=1 "$out/fuzz_$target" -max_total_time="$secs" \
            -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
            -dict="$here/$target.dict" -artifact_prefix="$out/" \
            "$out/corpus_$target" "$here/corpus/$target"; then
        echo "fuzz_$target FAILED: reproduce with $out/fuzz_$target $out/crash-..." >&2
        status=1
    fi
done
exit $status
