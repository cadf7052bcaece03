# Session 7, device call 2 (repo root on the GPU machine, .gpu carried): pair with 64-key
# forward softmax steps at d128; pairq (64-query dK/dV tiles at d128) and pairqi (and dV / dK
# interleaved). GPU tests; the sweep (bthd); bhtd against SDPA for pair, pairq, pairqi; ncu of
# the backward kernels at d128 x 4096 (pair, pairqi); seed-qwen2 end to end (rumble only).
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
RUMBLE_ATTN_LAYOUT=bthd RUMBLE_FLASH_SWEEP=1 timeout 200 $A > $OUT/attention-sweep-bthd.log 2>&1
echo "sweep rc=$? at ${SECONDS}s" >> $S
for c in pair pairq pairqi; do
  RUMBLE_FLASH_CFG=$c RUMBLE_ATTN_DUMP=/tmp/attn-$c timeout 60 $A > $OUT/attention-bhtd-$c.log 2>&1
  timeout 90 python3 bench/reference/attention_ref.py /tmp/attn-$c >> $OUT/attention-bhtd-$c.log 2>&1
  echo "bhtd $c rc=$? at ${SECONDS}s" >> $S
done
NCU=$(ls /usr/local/cuda/bin/ncu 2>/dev/null || command -v ncu)
if [ -n "$NCU" ] && [ $SECONDS -lt 400 ]; then
  for c in pair pairqi; do
    RUMBLE_FLASH_CFG=$c RUMBLE_ATTN_LAYOUT=bthd RUMBLE_ATTN_ITERS=1 RUMBLE_ATTN_SHAPES=d128-t4096 timeout 100 $NCU -c 2 -k regex:'flash_bwd_(dkdv|dq)$' \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
      $A > $OUT/ncu-bwd-d128-t4096-$c.txt 2>&1
    echo "ncu $c rc=$? at ${SECONDS}s" >> $S
  done
fi
timeout 60 .gpu/rumble bench seed-qwen2 --device cuda --json --steps 6 >> $OUT/bench.jsonl 2>> $OUT/rumble.err
echo "bench rc=$? at ${SECONDS}s" >> $S
cat $S; cat $OUT/bench.jsonl | cut -c1-400
echo "== sweep"; sed -n '/flash configurations/,$p' $OUT/attention-sweep-bthd.log | cut -c1-200
grep -E "^(pair)" $OUT/attention-sweep-bthd.log | grep -E "d128-t4096|d64-t4096" | cut -c1-220
for c in pair pairq pairqi; do echo "== bhtd $c"; grep -E "^(d64|d128|qwen2)" $OUT/attention-bhtd-$c.log | cut -c1-170; done
for c in pair pairqi; do echo "== ncu $c"; grep -E "^  flash_|Duration|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  |Registers Per|Mem Busy|Max Bandwidth|Achieved Occ|Shared" $OUT/ncu-bwd-d128-t4096-$c.txt 2>/dev/null | head -30; done
