# dclens: the two commands of the README.
#   make demo   set up, then run the synthetic benchmark + heatmaps on the bundled twins
#   make lint   ruff check + ruff format --check, mypy, clang-format --dry-run -Werror
#   make test   set up, then run every test: lint, C tests (ctest), C tests under ASan/UBSan,
#               a short fuzz run of the input parsers (make fuzz), pytest, the bit-identity
#               and tolerance files again under two more OpenBLAS kernels (test-kernels),
#               the engine's pytest files again against an ASan/UBSan build (asan-py), then
#               the documentation site (make docs)
#   make docs   the documentation site in build/site/ (mkdocs.yml; open build/site/index.html)
#   make fuzz   the fuzzers for 15 s each (docs/fuzzing.md: longer campaigns)
#   make build  the editable install's incremental rebuild (what the others run first)
#
# Everything C is built by CMake (CMakeLists.txt, CMakePresets.json; layers in
# docs/architecture.md): the Python module through scikit-build-core into
# build/<wheel tag>/, the C tests in build/dev/ and build/asan/, the fuzzers in
# engine/build/fuzz/. Each is incremental: an unchanged tree rebuilds nothing.
PY ?= python3
CMAKE_PY = -DPython_EXECUTABLE=$(shell command -v $(PY)) -DPython3_EXECUTABLE=$(shell command -v $(PY))

# Set-up, once (and again when the set-up script or the package's metadata
# change): system packages, build requirements, test extras, editable install.
build/.deps: scripts/install-deps.sh pyproject.toml
	PYTHON=$(PY) bash scripts/install-deps.sh
	@mkdir -p build && touch $@

deps: build/.deps

# The editable install's rebuild: CMake + ninja in build/<wheel tag>/ recompile
# only what changed (nothing, when nothing did); no dependency is installed.
build: deps
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

# C tests of one preset (dev, asan): configure once, build what changed, run.
# test_cuda is among them when nvcc was found (it skips without a GPU).
ctest-%: deps
	@test -f build/$*/CMakeCache.txt || cmake --preset $* $(CMAKE_PY) --log-level=WARNING
	cmake --build --preset $*
	ctest --preset $*

test: build
	$(MAKE) lint
	$(MAKE) ctest-dev
	$(MAKE) ctest-asan
	$(MAKE) fuzz
	$(PY) -m pytest -q tests
	$(MAKE) test-kernels
	$(MAKE) asan-py
	$(MAKE) docs

# The bit-identity and tolerance files (and test_kernels) under the generic OpenBLAS
# kernel and a second vector one: scripts/test_kernels.sh, docs/tolerances.md
test-kernels: build
	@test -f build/dev/CMakeCache.txt || cmake --preset dev $(CMAKE_PY) --log-level=WARNING
	cmake --build --preset dev --target test_kernels
	PY=$(PY) bash scripts/test_kernels.sh

# libFuzzer (C parsers, clang + ASan/UBSan) and atheris (JSONL loader) targets,
# 15 s each: engine/fuzz/run.sh, docs/fuzzing.md
fuzz: deps
	PY=$(PY) bash engine/fuzz/run.sh 15

# pytest files that drive the engine, against an ASan+UBSan build of the cffi
# extension (build/asan, copied into build/asan-py; the installed one is untouched)
asan-py: deps
	PY=$(PY) bash scripts/asan-py.sh

# The documentation site (mkdocs.yml: mkdocs-material, mkdocstrings, mkdocs-jupyter, from the
# [docs] extra) in build/site/, strict: a broken link or a page not in the nav fails it.
# First the public names: docs/reference/ must match dclens.__all__ and the public modules
# (python scripts/check_docstrings.py --write rewrites it), and every public name has a
# numpy-style docstring (its parameters, returns and raises: --strict fails otherwise).
docs: deps
	$(PY) scripts/check_docstrings.py --strict
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet
	@echo "docs: build/site/index.html"

# The field's habits, run first by `make test`: ruff (lint + format) on the
# Python, mypy on the package, clang-format on engine/ (.clang-format).
PYFILES = bindings synth_tasks tests scripts
lint:
	$(PY) -m ruff check $(PYFILES)
	$(PY) -m ruff format --check $(PYFILES)
	$(PY) -m mypy
	find engine -path engine/build -prune -o \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print \
		| xargs clang-format --dry-run -Werror

demo: build
	bash scripts/demo.sh

bench: build
	$(PY) scripts/bench.py

.PHONY: deps build test test-kernels fuzz asan-py demo bench lint docs
