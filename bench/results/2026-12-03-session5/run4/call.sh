# Session 5, device call 4 (same build as run 3, commit ac84dec): attention fa2 vs pair in the
# model's layout (bthd) in one process each, fa2 in bhtd against SDPA on the same inputs, then
# the transformers cross-check on CPU and CUDA, small and seed-qwen2 side by side with the references (a time guard stops before 420 s).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache PYTHONUNBUFFERED=1
[ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ] && tar xzf .gpu/kcache.tgz -C .gpu
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S; echo "commit $(cat .gpu/COMMIT) date $(date -u +%FT%TZ)" >> $S
for c in fa2 pair; do
  RUMBLE_ATTN_LAYOUT=bthd RUMBLE_FLASH_CFG=$c timeout 40 .gpu/bin/attention-bench > $OUT/attention-bthd-$c.log 2>&1
done
RUMBLE_ATTN_DUMP=/tmp/attn timeout 40 .gpu/bin/attention-bench > $OUT/attention-bhtd-fa2.log 2>&1
timeout 60 python3 bench/reference/attention_ref.py /tmp/attn >> $OUT/attention-bhtd-fa2.log 2>&1
echo "attention done at ${SECONDS}s" >> $S
timeout 120 .gpu/bin/reference --test-threads=1 > $OUT/test-reference.log 2>&1
echo "test reference (transformers cross-check, CPU and CUDA) rc=$? $(grep -E '^test result' $OUT/test-reference.log | tail -1)" >> $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
res=$OUT/bench.jsonl
for pr in small:rumble small:torch-eager small:torch-compile-ro small:thunder seed-qwen2:rumble seed-qwen2:thunder seed-qwen2:torch-compile-ro seed-qwen2:torch-eager; do
  w=${pr%%:*} r=${pr#*:}
  [ $SECONDS -gt 420 ] && { echo "$w $r skipped (time)" >> $S; continue; }
  if [ $r = rumble ]; then timeout 60 .gpu/rumble bench $w --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err
  else timeout 90 python3 bench/reference/torch_ref.py $w $r --steps 8 >> $res 2>> $OUT/ref.err || echo "{\"workload\":\"$w\",\"executor\":\"$r\",\"failed\":true}" >> $res; fi
  echo "$w $r done at ${SECONDS}s" >> $S
done
python3 bench/compare.py $res > $OUT/table.md
cat $S $OUT/table.md
for f in $OUT/attention-*.log; do echo "== $f"; grep -E "^(d64|d128|qwen2|llama)" $f | cut -c1-140; done
cd $OUT && tar czf /tmp/l.tgz --exclude=summary.txt --exclude=table.md --exclude=bench.jsonl . && find . -type f ! -name summary.txt ! -name table.md ! -name bench.jsonl -delete && mv /tmp/l.tgz logs.tgz
