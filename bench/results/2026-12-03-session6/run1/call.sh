# Session 6, device call 1 (repo root on the GPU machine, .gpu and .whl carried): the dK/dV
# head split and the unrolled 32-bit tile loader. GPU tests, then attention in the model's
# layout (bthd) with the default split, without it (RUMBLE_FLASH_SPLIT=1) and with pair's
# kernels; bhtd against SDPA on the same inputs; ncu of d128 x 4096; seed-qwen2 end to end.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache PYTHONUNBUFFERED=1
[ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ] && tar xzf .gpu/kcache.tgz -C .gpu
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S; echo "commit $(cat .gpu/COMMIT) date $(date -u +%FT%TZ)" >> $S
for t in flash ops exec scratch; do
  timeout 120 .gpu/bin/$t --test-threads=1 > $OUT/test-$t.log 2>&1
  echo "test $t rc=$? $(grep -E '^test result' $OUT/test-$t.log | tail -1)" >> $S
done
A=.gpu/bin/attention-bench
RUMBLE_ATTN_LAYOUT=bthd timeout 40 $A > $OUT/attention-bthd-fa2.log 2>&1
RUMBLE_ATTN_LAYOUT=bthd RUMBLE_FLASH_SPLIT=1 timeout 40 $A > $OUT/attention-bthd-fa2-split1.log 2>&1
RUMBLE_ATTN_LAYOUT=bthd RUMBLE_FLASH_CFG=pair timeout 40 $A > $OUT/attention-bthd-pair.log 2>&1
RUMBLE_ATTN_DUMP=/tmp/attn timeout 40 $A > $OUT/attention-bhtd-fa2.log 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
timeout 60 python3 bench/reference/attention_ref.py /tmp/attn >> $OUT/attention-bhtd-fa2.log 2>&1
echo "attention done at ${SECONDS}s" >> $S
NCU=$(ls /usr/local/cuda/bin/ncu 2>/dev/null || command -v ncu)
if [ -n "$NCU" ]; then
  RUMBLE_ATTN_LAYOUT=bthd RUMBLE_ATTN_ITERS=1 RUMBLE_ATTN_SHAPES=d128-t4096 timeout 150 $NCU -k regex:'flash_(fwd|bwd_dkdv|bwd_dq)$' \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy \
    $A > $OUT/ncu-d128-t4096.txt 2>&1
  echo "ncu rc=$? at ${SECONDS}s" >> $S
fi
res=$OUT/bench.jsonl
timeout 60 .gpu/rumble bench seed-qwen2 --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err
timeout 60 .gpu/rumble bench small --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err
echo "bench done at ${SECONDS}s" >> $S
python3 bench/compare.py $res > $OUT/table.md
cat $S $OUT/table.md
for f in $OUT/attention-*.log; do echo "== $f"; grep -E "^(d64|d128|qwen2|llama)|kernels:" $f | cut -c1-150; done
grep -E "Duration|Executed Instructions  |Registers Per|Achieved Occupancy|Issue Slots Busy|flash_" $OUT/ncu-d128-t4096.txt 2>/dev/null | head -40
cd $OUT && tar czf /tmp/l.tgz --exclude=summary.txt --exclude=table.md --exclude=bench.jsonl . && find . -type f ! -name summary.txt ! -name table.md ! -name bench.jsonl -delete && mv /tmp/l.tgz logs.tgz
