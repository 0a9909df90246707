#!/usr/bin/env bash
# Install what a fresh machine lacks, then build and install dclens (editable).
# Debian packages: libpng, cJSON, zlib, pkg-config, CMake + Ninja (the build),
# clang (fuzzers), chromium + chromium-driver (the explorer page's browser tests,
# tests/browser/test_explorer_browser.py). PyPI: the build requirements
# (scikit-build-core, cffi, scipy-openblas32: the engine's BLAS, the OpenBLAS
# numpy ships; no Debian OpenBLAS), then the package itself with its test extras, built without build
# isolation so that later rebuilds (`make build`, `pip install
# --no-build-isolation -e .`) reuse build/<wheel tag>/ and compile only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(build-essential pkg-config cmake ninja-build libpng-dev libcjson-dev zlib1g-dev clang clang-format)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Chromium for the explorer's browser tests: Debian's packages (on Ubuntu the
# chromium package is a snap wrapper that does not work in containers). Where
# they cannot be installed the set-up goes on and those tests skip, saying why.
if ! dpkg -s chromium >/dev/null 2>&1 || ! dpkg -s chromium-driver >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "install-deps: apt-get install chromium chromium-driver"
  $SUDO apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null ||
    echo "install-deps: chromium could not be installed; tests/browser/test_explorer_browser.py will skip"
fi

# libFuzzer's runtime is only a "Recommends" of clang: ask for it by name.
if command -v clang >/dev/null 2>&1; then
  v=$(clang -dumpversion | cut -d. -f1)
  if ! dpkg -s "libclang-rt-$v-dev" >/dev/null 2>&1 && apt-cache show "libclang-rt-$v-dev" >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "libclang-rt-$v-dev" >/dev/null
  fi
fi

PY=${PYTHON:-python3}
echo "install-deps: pip install scikit-build-core cffi scipy-openblas32; pip install --no-build-isolation -e .[test,distributed,docs]"
$PY -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10" "cffi>=1.15" "scipy-openblas32>=0.3.30"
# make lint: the linters, pinned so that every machine reports the same
$PY -m pip install -q --disable-pip-version-check "ruff==0.17.6" "mypy==2.4.1"
# test: pytest, selenium, JupyterLab + ipywidgets (tests/browser/); docs: mkdocs and its plugins (make docs)
$PY -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[test,distributed,docs]"
$PY -c "import dclens, synth_tasks; print('install-deps: dclens', dclens.__version__, '| blas:', dclens.blas.library(), dclens.blas.kernel(), '| cuda built:', 'yes' if 'built without' not in dclens.cuda_unavailable_reason() else 'no')"
