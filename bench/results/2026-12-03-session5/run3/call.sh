# Session 5, device call 2 (run from the repo root on the GPU machine, .gpu and .whl carried).
# Order by priority; every log under $OUT, packed into logs.tgz at the end.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache PYTHONUNBUFFERED=1
[ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ] && tar xzf .gpu/kcache.tgz -C .gpu  # scripts/gpu-prune packed it
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S; echo "commit $(cat .gpu/COMMIT)" >> $S
for t in ops flash exec scratch host buckets; do
  timeout 150 .gpu/bin/$t --test-threads=1 > $OUT/test-$t.log 2>&1
  echo "test $t rc=$? $(grep -E '^test result' $OUT/test-$t.log | tail -1)" >> $S
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
res=$OUT/bench.jsonl
timeout 150 .gpu/rumble bench seed-llama --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err || echo '{"workload":"seed-llama","executor":"rumble","failed":true}' >> $res
echo "rumble seed-llama done at ${SECONDS}s" >> $S
for r in torch-eager torch-compile-ro thunder-cudagraph; do
  timeout 130 python3 bench/reference/torch_ref.py seed-llama $r --steps 8 >> $res 2>> $OUT/ref.err || echo "{\"workload\":\"seed-llama\",\"executor\":\"$r\",\"failed\":true}" >> $res
  echo "ref seed-llama $r done at ${SECONDS}s" >> $S
done
RUMBLE_FLASH_FMA_SWEEP=1 timeout 90 .gpu/bin/attention-bench > $OUT/fma-sweep.log 2>&1; echo "fma sweep rc=$?" >> $S
timeout 60 .gpu/bin/matmul-bench > $OUT/matmul.log 2>&1; echo "matmul bench rc=$?" >> $S
cp $RUMBLE_CUDA_CACHE/matmul-*.txt $OUT/ 2>/dev/null
if [ $SECONDS -lt 430 ]; then
  for w in small seed-qwen2; do timeout 60 .gpu/rumble bench $w --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err; done
fi
if [ $SECONDS -lt 480 ]; then timeout 70 .gpu/rumble bench seed-llama --device cuda --profile > $OUT/profile-seed-llama.txt 2>&1; echo "profile rc=$?" >> $S; fi
python3 bench/compare.py $res > $OUT/table.md
cat $S $OUT/table.md
tail -25 $OUT/fma-sweep.log
cat $OUT/matmul.log
head -22 $OUT/profile-seed-llama.txt 2>/dev/null
tail -3 $OUT/rumble.err $OUT/ref.err 2>/dev/null
cd $OUT && tar czf /tmp/l.tgz --exclude=summary.txt --exclude=table.md --exclude=bench.jsonl . && find . -type f ! -name summary.txt ! -name table.md ! -name bench.jsonl -delete && mv /tmp/l.tgz logs.tgz
