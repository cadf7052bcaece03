#!/usr/bin/env bash
# The combined GPU call of a session (from the repo root on the GPU machine, .gpu/ and .whl/
# carried): bench/gpu-session.sh (tests, sanitizer, cross-check, profiles, rumble bench,
# references; see its env switches), then the flash-attention sweeps (every bf16 tiling
# configuration, both f32 tilings) and a bucketed training run. Everything it wrote goes into
# one archive, $OUT/logs.tgz (the device tool returns few files).
set -uo pipefail
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache
mkdir -p "$OUT"
bash bench/gpu-session.sh > "$OUT/session.txt" 2>&1
if [ "${SWEEP:-1}" = 1 ]; then
  RUMBLE_FLASH_SWEEP=1 timeout 200 .gpu/bin/attention-bench > "$OUT/sweep-bf16.txt" 2>&1
  for c in a b; do
    RUMBLE_FLASH_FMA_CFG=$c RUMBLE_ATTN_SHAPES=llama-f32-d100-t2048 timeout 60 .gpu/bin/attention-bench > "$OUT/sweep-f32-$c.txt" 2>&1
    RUMBLE_FLASH_FMA_CFG=$c timeout 100 .gpu/bin/flash --test-threads=1 > "$OUT/test-flash-f32$c.txt" 2>&1
    echo "flash tests with FMA cfg $c: rc=$? $(grep -E '^test result' "$OUT/test-flash-f32$c.txt" | tail -1)" >> "$OUT/session.txt"
  done
fi
if [ "${BUCKETS:-1}" = 1 ]; then
  timeout 120 .gpu/rumble train --device cuda --buckets 64,128,256 --steps 60 --json --log-every 20 --out /tmp/bk > "$OUT/train-buckets.txt" 2>&1
  echo "bucketed train rc=$? $(tail -c 600 "$OUT/train-buckets.txt" | tr '\n' ' ')" >> "$OUT/session.txt"
fi
cat "$OUT/session.txt"
tail -32 "$OUT/sweep-bf16.txt"
for c in a b; do grep -E "llama-f32" "$OUT/sweep-f32-$c.txt" | sed "s/^/f32 cfg $c: /"; done
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -type f -delete && mv /tmp/logs.tgz "$OUT/logs.tgz"
