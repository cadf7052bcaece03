# Session 7, device call 3 (repo root on the GPU machine, .gpu carried): the wgmma (sm_90a)
# forward, dQ and dK/dV at head sizes 64 and 128. GPU tests; bhtd against SDPA with them and
# with RUMBLE_FLASH_WG=0 (pair's mma.sync kernels); bthd both ways; ncu of the wgmma kernels at
# d128 x 4096; seed-qwen2 end to end (rumble).
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
for wg in 1 0; do
  RUMBLE_FLASH_WG=$wg RUMBLE_ATTN_DUMP=/tmp/attn-$wg timeout 60 $A > $OUT/attention-bhtd-wg$wg.log 2>&1
  timeout 90 python3 bench/reference/attention_ref.py /tmp/attn-$wg >> $OUT/attention-bhtd-wg$wg.log 2>&1
  echo "bhtd wg$wg rc=$? at ${SECONDS}s" >> $S
  RUMBLE_FLASH_WG=$wg RUMBLE_ATTN_LAYOUT=bthd timeout 60 $A > $OUT/attention-bthd-wg$wg.log 2>&1
  echo "bthd wg$wg rc=$? at ${SECONDS}s" >> $S
done
NCU=$(ls /usr/local/cuda/bin/ncu 2>/dev/null || command -v ncu)
if [ -n "$NCU" ] && [ $SECONDS -lt 400 ]; then
  RUMBLE_ATTN_LAYOUT=bthd RUMBLE_ATTN_ITERS=1 RUMBLE_ATTN_SHAPES=d128-t4096 timeout 120 $NCU -c 3 -k regex:'flash_(fwd|bwd_dkdv|bwd_dq)$' \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
    $A > $OUT/ncu-wg-d128-t4096.txt 2>&1
  echo "ncu rc=$? at ${SECONDS}s" >> $S
fi
timeout 60 .gpu/rumble bench seed-qwen2 --device cuda --json --steps 6 >> $OUT/bench.jsonl 2>> $OUT/rumble.err
echo "bench rc=$? at ${SECONDS}s" >> $S
cat $S; cut -c1-300 $OUT/bench.jsonl
grep -E "^(FAIL|thread|  left|  right)|panicked" $OUT/test-flash.log | head -20
for f in $OUT/attention-bhtd-wg1.log $OUT/attention-bhtd-wg0.log $OUT/attention-bthd-wg1.log $OUT/attention-bthd-wg0.log; do echo "== $f"; grep -E "^(d64|d128|qwen2|llama)|kernels:" $f | cut -c1-190; done
echo "== ncu"; grep -E "^  flash_|Duration|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  |Registers Per|Mem Busy|Achieved Occ|highest-utilized" $OUT/ncu-wg-d128-t4096.txt 2>/dev/null | head -30
