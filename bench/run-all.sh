#!/usr/bin/env bash
# On the GPU machine, from the repo root, with .gpu/ (scripts/gpu-build) and .whl/
# (bench/prepare.sh) carried along: runs `rumble bench` and the PyTorch/Thunder references for
# each workload, one process per configuration, then prints the side-by-side table.
#   WORKLOADS="small seed-qwen2 seed-llama"   which workloads
#   REFS="torch-eager torch-compile ..."      which reference executors
#   PER=180                                   seconds allowed per configuration
#   EXTRA="--train"                           extra flags for both sides
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
[ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ] && tar xzf .gpu/kcache.tgz -C .gpu  # scripts/gpu-prune packed it
export RUMBLE_CUDA_CACHE=${RUMBLE_CUDA_CACHE:-$PWD/.gpu/kcache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
results=$OUT/bench.jsonl
for w in ${WORKLOADS:-small seed-qwen2 seed-llama}; do
  timeout "${PER:-180}" .gpu/rumble bench "$w" --device cuda --json ${EXTRA:-} >> "$results" 2>> "$OUT/rumble.err" \
    || echo "{\"workload\":\"$w\",\"executor\":\"rumble\",\"failed\":true}" >> "$results"
  for r in ${REFS:-torch-eager torch-compile torch-compile-ro thunder thunder-cudagraph}; do
    timeout "${PER:-180}" python3 bench/reference/torch_ref.py "$w" "$r" ${EXTRA:-} >> "$results" 2>> "$OUT/ref.err" \
      || echo "{\"workload\":\"$w\",\"executor\":\"$r\",\"failed\":true}" >> "$results"
  done
done
python3 bench/compare.py "$results" | tee "$OUT/table.md"
