#!/usr/bin/env bash
# Here (no GPU needed), from the repo root: downloads the Python wheels the GPU machine lacks
# (lightning-thunder, litgpt and their missing needs) into .whl/, which git ignores.
# The GPU machine then installs them offline (scripts/gpu does it when .whl/ is carried).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  lightning-thunder==0.2.6 litgpt==0.5.13 looseversion==1.3.0 optree==0.20.0 dill==0.4.1
ls .whl
