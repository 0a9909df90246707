# dcscope: the two commands of the README.
#   make demo   set up, then run the synthetic benchmark + heatmaps on generated models
#   make test   set up, then run every test: C tests, C tests under ASan/UBSan, a short
#               fuzz run of the input parsers (make fuzz), pytest, and the engine's pytest
#               files again against an ASan/UBSan build (asan-py)
#   make fuzz   the fuzzers for 15 s each (docs/fuzzing.md: longer campaigns)
PY ?= python3
ENGINE_SRCS := $(wildcard engine/src/*.c engine/src/*.h engine/src/cuda/*.cu engine/include/*.h)

build/.deps: scripts/install-deps.sh pyproject.toml setup.py bindings/build_engine.py bindings/dcscope/_cdef.py $(ENGINE_SRCS)
	bash scripts/install-deps.sh
	@mkdir -p build && touch $@

deps: build/.deps

NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)

test: deps
	$(MAKE) -C engine test
	$(MAKE) -C engine asan
	@if [ -n "$(NVCC)" ]; then $(MAKE) -C engine cuda-test NVCC=$(NVCC); else echo "no nvcc: CUDA backend not built"; fi
	$(MAKE) fuzz
	$(PY) -m pytest -q tests
	$(MAKE) asan-py

# libFuzzer (C parsers, clang + ASan/UBSan) and atheris (JSONL loader) targets,
# 15 s each: engine/fuzz/run.sh, docs/fuzzing.md
fuzz: deps
	PY=$(PY) bash engine/fuzz/run.sh 15

# pytest files that drive the engine, against an ASan+UBSan build of the cffi
# extension in build/asan-py (the installed one is untouched)
asan-py: deps
	PY=$(PY) bash scripts/asan-py.sh

demo: deps
	bash scripts/demo.sh

bench: deps
	$(PY) scripts/bench.py

.PHONY: deps test fuzz asan-py demo bench
