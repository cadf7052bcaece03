# Session 5, device call 3 (from the repo root on the GPU machine, .gpu and .whl carried):
# merged main (classic-cuBLAS candidate, packed gate/up, bthd attention, fa2 default).
# GPU tests, then seed-llama side by side with PyTorch eager, torch.compile reduce-overhead
# and Thunder + CUDA graphs, then attention (fa2 vs pair, bthd), the other workloads, profile.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache PYTHONUNBUFFERED=1
[ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ] && tar xzf .gpu/kcache.tgz -C .gpu
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S; echo "commit $(cat .gpu/COMMIT) date $(date -u +%FT%TZ)" >> $S
for t in ops flash exec scratch host buckets; do
  timeout 120 .gpu/bin/$t --test-threads=1 > $OUT/test-$t.log 2>&1
  echo "test $t rc=$? $(grep -E '^test result' $OUT/test-$t.log | tail -1)" >> $S
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
res=$OUT/bench.jsonl
timeout 150 .gpu/rumble bench seed-llama --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err || echo '{"workload":"seed-llama","executor":"rumble","failed":true}' >> $res
echo "rumble seed-llama done at ${SECONDS}s" >> $S
for r in torch-eager torch-compile-ro thunder-cudagraph; do
  timeout 120 python3 bench/reference/torch_ref.py seed-llama $r --steps 8 >> $res 2>> $OUT/ref.err || echo "{\"workload\":\"seed-llama\",\"executor\":\"$r\",\"failed\":true}" >> $res
  echo "ref seed-llama $r done at ${SECONDS}s" >> $S
done
if [ $SECONDS -lt 470 ]; then
  RUMBLE_ATTN_LAYOUT=bthd RUMBLE_ATTN_DUMP=/tmp/attn timeout 40 .gpu/bin/attention-bench > $OUT/attention-fa2.log 2>&1
  timeout 40 python3 bench/reference/attention_ref.py /tmp/attn >> $OUT/attention-fa2.log 2>&1
  RUMBLE_ATTN_LAYOUT=bthd RUMBLE_FLASH_CFG=pair timeout 30 .gpu/bin/attention-bench > $OUT/attention-pair.log 2>&1
  echo "attention done at ${SECONDS}s" >> $S
fi
for w in small seed-qwen2; do
  [ $SECONDS -lt 520 ] && timeout 40 .gpu/rumble bench $w --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err
done
[ $SECONDS -lt 530 ] && timeout 45 .gpu/rumble bench seed-llama --device cuda --profile > $OUT/profile-seed-llama.txt 2>&1
cp $RUMBLE_CUDA_CACHE/matmul-*.txt $OUT/ 2>/dev/null
python3 bench/compare.py $res > $OUT/table.md
cat $S $OUT/table.md
grep -E "^(d64|d128|qwen2|llama)" $OUT/attention-fa2.log $OUT/attention-pair.log | cut -c1-150
head -16 $OUT/profile-seed-llama.txt 2>/dev/null
tail -2 $OUT/rumble.err $OUT/ref.err 2>/dev/null
cd $OUT && tar czf /tmp/l.tgz --exclude=summary.txt --exclude=table.md --exclude=bench.jsonl . && find . -type f ! -name summary.txt ! -name table.md ! -name bench.jsonl -delete && mv /tmp/l.tgz logs.tgz
