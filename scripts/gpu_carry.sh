#!/usr/bin/env bash
# What a lent GPU machine (no network) needs for scripts/gpu_check.sh, gathered here into the
# git-ignored folder .gpu_carry/ (name it in the device tool's `carry`):
#
#     bash scripts/gpu_carry.sh [DCFORMER_CHECKOUT]
#
#   debs/        Debian packages of libpng, cJSON and zlib headers (apt-get download;
#                gpu_env.sh unpacks them into /tmp/deps and builds dclens against them)
#   dclens_whl/  cffi, pycparser and scipy-openblas32 (the engine's BLAS) wheels for the machine's
#                Python 3.12 (pip download)
#   DCFormer/    pytorch/dcpythia of github.com/Caiyun-AI/DCFormer (the official module that
#                scripts/bench_cuda_vs_official.py imports from a path; never copied into the
#                project): from DCFORMER_CHECKOUT (a clone, or a bare mirror) or a fresh clone
#   whl/         the transformers version that module needs and the packages its import-time
#                version check asks for (scripts/bench_cuda_vs_official.py --print-wheels)
#
# Everything is downloaded, nothing is built; the folder stays under the tool's 64 MiB.
set -eu
cd "$(dirname "$0")/.."
C=.gpu_carry
mkdir -p "$C/debs" "$C/dclens_whl" "$C/whl"
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || echo '/.gpu_carry/' >>.git/info/exclude

(
  cd "$C/debs"
  apt-get download -q libpng-dev libpng16-16 libcjson-dev libcjson1 zlib1g-dev
)

PIP="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
PIP="$PIP --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
$PIP -d "$C/dclens_whl" cffi pycparser scipy-openblas32

src=${1:-}
rm -rf "$C/DCFormer" && mkdir -p "$C/DCFormer/pytorch"
if [ -z "$src" ]; then
  src=$(mktemp -d)
  git clone -q --depth 1 https://github.com/Caiyun-AI/DCFormer "$src/DCFormer"
  src=$src/DCFormer
fi
if [ -d "$src/pytorch/dcpythia" ]; then
  cp -r "$src/pytorch/dcpythia" "$C/DCFormer/pytorch/"
else # a bare mirror
  mkdir -p "$C/DCFormer/pytorch/dcpythia"
  git --git-dir="$src" archive HEAD pytorch/dcpythia 2>/dev/null | tar -x -C "$C/DCFormer"
fi
# shellcheck disable=SC2046  # one requirement a word
$PIP -d "$C/whl" $(python3 scripts/bench_cuda_vs_official.py --print-wheels)
du -sh "$C"/*
