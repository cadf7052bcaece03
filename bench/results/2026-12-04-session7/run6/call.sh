# Session 7, device call 6 (repo root on the GPU machine, .gpu and .whl carried): the fixed wgmma
# forward. GPU tests; the d128 sweep (fwd_wg's softmax forms: pair 1, pair8 0, paird 2); bhtd
# against SDPA and bthd with the default. (seed-qwen2 end to end: run 4, whose head-size-1
# kernels are these.)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache PYTHONUNBUFFERED=1
[ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ] && tar xzf .gpu/kcache.tgz -C .gpu
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S; echo "commit $(cat .gpu/COMMIT) date $(date -u +%FT%TZ)" >> $S
for t in flash ops exec scratch; do
  timeout 150 .gpu/bin/$t --test-threads=1 > $OUT/test-$t.log 2>&1
  echo "test $t rc=$? $(grep -E '^test result' $OUT/test-$t.log | tail -1)" >> $S
done
A=.gpu/bin/attention-bench
RUMBLE_ATTN_LAYOUT=bthd RUMBLE_FLASH_SWEEP=1 RUMBLE_ATTN_SHAPES=d128-t2048,d128-t4096 timeout 150 $A > $OUT/attention-sweep-bthd.log 2>&1
echo "sweep rc=$? at ${SECONDS}s" >> $S
RUMBLE_ATTN_DUMP=/tmp/attn timeout 60 $A > $OUT/attention-bhtd.log 2>&1
timeout 90 python3 bench/reference/attention_ref.py /tmp/attn >> $OUT/attention-bhtd.log 2>&1
echo "bhtd rc=$? at ${SECONDS}s" >> $S
RUMBLE_ATTN_LAYOUT=bthd timeout 60 $A > $OUT/attention-bthd.log 2>&1
echo "bthd rc=$? at ${SECONDS}s" >> $S
cat $S
grep -E "^(FAIL|thread)|panicked" $OUT/test-*.log | head -10
echo "== sweep"; sed -n '/flash configurations/,$p' $OUT/attention-sweep-bthd.log | cut -c1-200
grep -E "^(pair|paird|pair8) " $OUT/attention-sweep-bthd.log | cut -c1-200
for f in $OUT/attention-bhtd.log $OUT/attention-bthd.log; do echo "== $f"; grep -E "^(d64|d128|qwen2|llama)|kernels:" $f | cut -c1-190; done
