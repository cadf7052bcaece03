# Session 5, device call 2: the classic-cuBLAS matmul candidate, packed gate/up and the fa2
# default on the H200: GPU tests, rumble bench on the three workloads, matmul bench, profile.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache PYTHONUNBUFFERED=1
[ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ] && tar xzf .gpu/kcache.tgz -C .gpu
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S; echo "commit $(cat .gpu/COMMIT)" >> $S
for t in ops flash exec scratch host buckets; do
  timeout 150 .gpu/bin/$t --test-threads=1 > $OUT/test-$t.log 2>&1
  echo "test $t rc=$? $(grep -E '^test result' $OUT/test-$t.log | tail -1)" >> $S
done
res=$OUT/bench.jsonl
for w in seed-llama small seed-qwen2; do
  timeout 150 .gpu/rumble bench $w --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err || echo "{\"workload\":\"$w\",\"executor\":\"rumble\",\"failed\":true}" >> $res
done
echo "benches done at ${SECONDS}s" >> $S
timeout 60 .gpu/bin/matmul-bench > $OUT/matmul.log 2>&1; echo "matmul bench rc=$?" >> $S
cp $RUMBLE_CUDA_CACHE/matmul-*.txt $OUT/ 2>/dev/null
timeout 90 .gpu/rumble bench seed-llama --device cuda --profile > $OUT/profile-seed-llama.txt 2>&1; echo "profile rc=$?" >> $S
python3 bench/compare.py $res > $OUT/table.md
cat $S $OUT/table.md $OUT/matmul.log
head -24 $OUT/profile-seed-llama.txt
grep -i "classic\|cublas\|error" $OUT/test-ops.log | tail -5
tail -3 $OUT/rumble.err 2>/dev/null
cd $OUT && tar czf /tmp/l.tgz --exclude=summary.txt --exclude=table.md --exclude=bench.jsonl . && find . -type f ! -name summary.txt ! -name table.md ! -name bench.jsonl -delete && mv /tmp/l.tgz logs.tgz
