# Session 7, device call 1 (repo root on the GPU machine, .gpu carried): the atomic-dQ
# configurations atom / atom8 (dQ inside dK/dV) beside pair (default) and pair8. GPU tests; the
# tiling sweep (bthd, all 9 configurations); bhtd against SDPA with pair, atom and atom8 (each
# its own dump, SDPA timed again on each); ncu of d128 x 4096 with atom8 and pair.
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
for c in pair atom atom8; do
  RUMBLE_FLASH_CFG=$c RUMBLE_ATTN_DUMP=/tmp/attn-$c timeout 60 $A > $OUT/attention-bhtd-$c.log 2>&1
  timeout 90 python3 bench/reference/attention_ref.py /tmp/attn-$c >> $OUT/attention-bhtd-$c.log 2>&1
  echo "bhtd $c rc=$? at ${SECONDS}s" >> $S
done
NCU=$(ls /usr/local/cuda/bin/ncu 2>/dev/null || command -v ncu)
if [ -n "$NCU" ] && [ $SECONDS -lt 420 ]; then
  for c in atom8 pair; do
    RUMBLE_FLASH_CFG=$c RUMBLE_ATTN_LAYOUT=bthd RUMBLE_ATTN_ITERS=1 RUMBLE_ATTN_SHAPES=d128-t4096 timeout 100 $NCU -c 4 -k regex:'flash_(fwd|bwd_dkdv|bwd_dq)$' \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
      $A > $OUT/ncu-d128-t4096-$c.txt 2>&1
    echo "ncu $c rc=$? at ${SECONDS}s" >> $S
  done
fi
cat $S
echo "== sweep"; sed -n '/flash configurations/,$p' $OUT/attention-sweep-bthd.log | cut -c1-200
grep -E "^(atom|pair)" $OUT/attention-sweep-bthd.log | grep d128-t4096 | cut -c1-220
for c in pair atom atom8; do echo "== bhtd $c"; grep -E "^(d64|d128|qwen2)|ratio|rumble/|backend" $OUT/attention-bhtd-$c.log | cut -c1-170; done
for c in atom8 pair; do echo "== ncu $c"; grep -E "^  flash_|Duration|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  |Registers Per|Stall|L1/TEX Hit|Mem Busy|Max Bandwidth" $OUT/ncu-d128-t4096-$c.txt 2>/dev/null | head -45; done
