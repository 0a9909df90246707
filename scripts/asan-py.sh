#!/usr/bin/env bash
# Python tests against an AddressSanitizer + UBSan build of the engine
# (`make asan-py`, part of `make test`): the test files that drive the
# engine (ASAN_PY_TESTS overrides the list; extra arguments go to pytest).
#
# The sanitized cffi extension is built by CMake's "asan" preset (build/asan/,
# target _engine; the editable install and its extension are left alone) and
# copied next to a copy of the dclens package in build/asan-py/site, which
# shadows the installed one through PYTHONPATH (and a sitecustomize.py that
# takes the editable install's import redirect out of the way).
# Python itself is not instrumented, so libasan is preloaded (it must be the
# first library loaded), with libstdc++ (else ASan's __cxa_throw interceptor
# aborts the first C++ exception of a C++ extension such as matplotlib's),
# and leak detection is off: CPython keeps memory until exit by design. Any
# ASan report or UBSan finding aborts the process, and with it pytest, with a
# nonzero status. A deliberate overflow first checks that ASan is live.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-${PYTHON:-python3}}
CC=${CC:-gcc}
OUT=build/asan-py
TESTS=${ASAN_PY_TESTS:-tests/passes/test_parity.py tests/passes/test_hooks.py tests/api/test_errors.py tests/analyses/test_circuits.py tests/analyses/test_heatmap.py tests/synth/test_synth_eval.py tests/api/test_bundled.py tests/passes/test_decode.py tests/analyses/test_patching.py tests/passes/test_variants.py tests/analyses/test_analysis.py tests/passes/test_grad.py tests/analyses/test_attribution.py tests/passes/test_train.py tests/passes/test_robustness.py tests/passes/test_fast_path.py tests/passes/test_dcformer.py tests/passes/test_tape_cache.py tests/passes/test_compose_blocks.py tests/passes/test_partition.py tests/passes/test_train_threads.py tests/passes/test_train_bucket.py tests/passes/test_split_input.py tests/analyses/test_graph.py tests/passes/test_plan.py tests/passes/test_tape_read.py tests/passes/test_tape_stage.py tests/passes/test_load_dtype.py tests/passes/test_attention_chunks.py tests/features/test_sae.py}

libasan=$("$CC" -print-file-name=libasan.so)
if [ ! -e "$libasan" ]; then
    echo "asan-py: libasan.so not found ('$CC -print-file-name=libasan.so' gave '$libasan'); install gcc's libasan" >&2
    exit 1
fi

mkdir -p "$OUT"
echo "asan-py: building the engine with -fsanitize=address,undefined (cmake --preset asan, target _engine)"
pyexe=$(command -v "$PY")
if ! { cmake --preset asan -DDCLENS_PYTHON=ON -DPython_EXECUTABLE="$pyexe" --log-level=WARNING &&
       cmake --build --preset asan-py; } >"$OUT/build.log" 2>&1; then
    tail -n 40 "$OUT/build.log" >&2
    echo "asan-py: build failed (log: $OUT/build.log)" >&2
    exit 1
fi
rm -rf "$OUT/site"
mkdir -p "$OUT/site"
cp -R bindings/dclens "$OUT/site/dclens"
find "$OUT/site" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
cp build/asan/_engine*.so "$OUT/site/dclens/"
# An editable install (scikit-build-core) puts an import redirect first on
# sys.meta_path, ahead of PYTHONPATH: drop it in this process tree so that
# the copy above is the dclens that is imported.
cat >"$OUT/site/sitecustomize.py" <<'PYEOF'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__name__.startswith("ScikitBuild")]
PYEOF

export PYTHONPATH="$PWD/$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
preload=$libasan
libstdcxx=$("$CC" -print-file-name=libstdc++.so.6)
[ -e "$libstdcxx" ] && preload="$preload:$libstdcxx"
export LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=0:print_summary=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

# the sanitized extension must be the one imported
"$PY" -c "import dclens._engine as e, sys; f = e.__file__; sys.exit(0 if '/$OUT/site/' in f else 'asan-py: imported ' + f + ', not the sanitized build')"
# and instrumented: a 3-byte write at the last byte of a malloc'd buffer
canary=$("$PY" - 2>&1 <<'EOF' || true
import numpy as np
from dclens._engine import ffi, lib
a = np.empty(4096, np.uint8)                 # > numpy's small-block cache: malloc
lib.dcs_colormap_rgb(0, 0.5, 0.0, 1.0, ffi.cast("uint8_t *", ffi.from_buffer(a)) + 4095)
print("asan-py: the overflow went unnoticed")
EOF
)
case "$canary" in
*"AddressSanitizer: heap-buffer-overflow"*) echo "asan-py: ASan is live (canary overflow caught)" ;;
*) printf '%s\n' "$canary" | tail -n 20 >&2; echo "asan-py: ASan is not active in the sanitized build" >&2; exit 1 ;;
esac

# shellcheck disable=SC2086
exec "$PY" -m pytest -q -p no:cacheprovider $TESTS "$@"
