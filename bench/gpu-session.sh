#!/usr/bin/env bash
# One GPU call that checks and measures what matters most, in priority order, each part with
# its own time limit (for leases of a few minutes). From the repo root on the GPU machine, with
# .gpu/ and .whl/ carried. Logs go to $OUT; a short summary is printed last.
#   1. the flash-attention and op tests (if flash fails, the benches fall back to the old kernel)
#   2. rumble bench on small, seed-qwen2, seed-llama (eager, planned, graphed)
#   3. the attention bench against PyTorch SDPA
#   4. the references (PyTorch eager, torch.compile, Thunder; REF_PAIRS or REFS x REF_WORKLOADS)
# Optional parts (env): REF_PROFILE=workload:executor (that reference also writes a torch.profiler
# table of its kernels, torch-profile-*.txt), SANITIZE=1 (compute-sanitizer memcheck + racecheck on a graphed
# training step of the tiny model), PROFILE="w ..." (rumble bench --profile: device time per
# op and the slowest nodes), XCHECK=1 (make_reference.py with this machine's transformers, then
# the cross-check test on CPU and CUDA), ATTN=0 (skip the attention bench). Every log but
# summary.txt, table.md and bench.jsonl ends up in $OUT/logs.tgz (PACK=0: left loose).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
[ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ] && tar xzf .gpu/kcache.tgz -C .gpu  # scripts/gpu-prune packed it
export RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/summary.txt"
echo "commit $(cat .gpu/COMMIT)" >> "$OUT/summary.txt"
for t in ${TESTS-flash ops exec}; do
  timeout "${TEST_TIMEOUT:-120}" .gpu/bin/$t --test-threads=1 > "$OUT/test-$t.log" 2>&1
  rc=$?
  echo "test $t rc=$rc $(grep -E '^test result' "$OUT/test-$t.log" | tail -1)" >> "$OUT/summary.txt"
  if [ "$t" = flash ] && [ $rc != 0 ]; then export RUMBLE_ATTENTION=naive; echo "flash failed: benches use the old attention kernel" >> "$OUT/summary.txt"; fi
done
if [ "${SANITIZE:-0}" = 1 ]; then
  cs=/usr/local/cuda/bin/compute-sanitizer
  for tool in memcheck racecheck; do
    timeout "${SAN_TIMEOUT:-240}" $cs --tool $tool --error-exitcode 9 .gpu/rumble bench tiny --device cuda --executor graphed --train --steps 2 --json > "$OUT/sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)" >> "$OUT/summary.txt"
  done
fi
if [ "${XCHECK:-0}" = 1 ]; then
  ref=/tmp/hfref
  rm -rf $ref && mkdir -p $ref && cp -r crates/rumble-models/tests/reference/rumble_bf16_untied $ref/ && rm -f $ref/rumble_bf16_untied/reference.safetensors
  timeout 180 python3 crates/rumble-models/tests/reference/make_reference.py $ref $ref/rumble_bf16_untied > "$OUT/xcheck.log" 2>&1
  RUMBLE_REFERENCE_DIR=$ref timeout 120 .gpu/bin/reference --test-threads=1 --nocapture >> "$OUT/xcheck.log" 2>&1
  echo "transformers cross-check rc=$? $(grep -E '^test result' "$OUT/xcheck.log" | tail -1) $(grep -o '"transformers": "[^"]*"' "$OUT/xcheck.log")" >> "$OUT/summary.txt"
fi
for w in ${PROFILE:-}; do
  timeout 150 .gpu/rumble bench "$w" --device cuda --profile > "$OUT/profile-$w.txt" 2>&1
  echo "profile $w rc=$? $(head -1 "$OUT/profile-$w.txt")" >> "$OUT/summary.txt"
done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
res=$OUT/bench.jsonl
for w in ${WORKLOADS-small seed-qwen2 seed-llama}; do
  timeout "${PER:-150}" .gpu/rumble bench "$w" --device cuda --json --steps "${STEPS:-6}" >> "$res" 2>> "$OUT/rumble.err" \
    || echo "{\"workload\":\"$w\",\"executor\":\"rumble\",\"failed\":true}" >> "$res"
done
if [ "${ATTN:-1}" = 1 ]; then
  RUMBLE_ATTN_DUMP=/tmp/rumble-attn timeout 150 .gpu/bin/attention-bench > "$OUT/attention.log" 2>&1
  timeout 120 python3 bench/reference/attention_ref.py /tmp/rumble-attn >> "$OUT/attention.log" 2>&1
fi
# The references: REF_PAIRS="workload:executor ..." in order, or every REFS executor on every
# REF_WORKLOADS workload. None starts once BUDGET seconds (default 540) have passed since the
# session began, so the summary still prints inside the call's time limit.
pairs=${REF_PAIRS:-}
if [ -z "$pairs" ]; then
  for w in ${REF_WORKLOADS-small seed-qwen2}; do for r in ${REFS:-torch-eager torch-compile-ro}; do pairs="$pairs $w:$r"; done; done
fi
for pr in $pairs; do
  w=${pr%%:*} r=${pr#*:}
  if [ $((SECONDS + ${REF_PER:-120})) -gt "${BUDGET:-540}" ]; then
    echo "reference $w $r skipped: the session's time budget is spent" >> "$OUT/summary.txt"
    continue
  fi
  prof=()
  [ -n "${REF_PROFILE:-}" ] && [ "$pr" = "$REF_PROFILE" ] && prof=(--profile "$OUT/torch-profile-$w-$r.txt")
  timeout "${REF_PER:-120}" python3 bench/reference/torch_ref.py "$w" "$r" --steps 8 "${prof[@]}" >> "$res" 2>> "$OUT/ref.err" \
    || echo "{\"workload\":\"$w\",\"executor\":\"$r\",\"failed\":true}" >> "$res"
done
python3 bench/compare.py "$res" > "$OUT/table.md"
cat "$OUT/summary.txt" "$OUT/table.md"
sed -n '/^attention fwd+bwd/,$p' "$OUT/attention.log" 2>/dev/null | head -30
tail -3 "$OUT/rumble.err" 2>/dev/null
# A device call brings back only a few files: every log goes into one archive beside the summary,
# the table and the results (PACK=0 leaves them loose).
if [ "${PACK:-1}" = 1 ]; then
  (cd "$OUT" && tar czf /tmp/session-logs.tgz --exclude=summary.txt --exclude=table.md --exclude=bench.jsonl . \
    && find . -type f ! -name summary.txt ! -name table.md ! -name bench.jsonl -delete \
    && mv /tmp/session-logs.tgz logs.tgz)
fi
