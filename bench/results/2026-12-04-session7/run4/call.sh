# Session 7, device call 4 (repo root on the GPU machine, .gpu and .whl carried): the wgmma
# forward's three softmax forms (FWGV: pair 1, pair8 0, paird 2) in the sweep; GPU tests;
# bhtd against SDPA and bthd with the default; seed-qwen2 end to end beside the references.
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
RUMBLE_ATTN_LAYOUT=bthd RUMBLE_FLASH_SWEEP=1 RUMBLE_ATTN_SHAPES=d128-t2048,d128-t4096,d64-t4096 timeout 150 $A > $OUT/attention-sweep-bthd.log 2>&1
echo "sweep rc=$? at ${SECONDS}s" >> $S
RUMBLE_ATTN_DUMP=/tmp/attn timeout 60 $A > $OUT/attention-bhtd.log 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
timeout 90 python3 bench/reference/attention_ref.py /tmp/attn >> $OUT/attention-bhtd.log 2>&1
echo "bhtd rc=$? at ${SECONDS}s" >> $S
RUMBLE_ATTN_LAYOUT=bthd timeout 60 $A > $OUT/attention-bthd.log 2>&1
echo "bthd rc=$? at ${SECONDS}s" >> $S
res=$OUT/bench.jsonl
for pr in seed-qwen2:rumble seed-qwen2:torch-eager seed-qwen2:torch-compile-ro seed-qwen2:thunder-cudagraph small:rumble; do
  w=${pr%%:*} r=${pr#*:}
  [ $SECONDS -gt 500 ] && { echo "$w $r skipped (time)" >> $S; continue; }
  if [ $r = rumble ]; then timeout 60 .gpu/rumble bench $w --device cuda --json --steps 6 >> $res 2>> $OUT/rumble.err
  else timeout 100 python3 bench/reference/torch_ref.py $w $r --steps 8 >> $res 2>> $OUT/ref.err || echo "{\"workload\":\"$w\",\"executor\":\"$r\",\"failed\":true}" >> $res; fi
  echo "$w $r done at ${SECONDS}s" >> $S
done
python3 bench/compare.py $res > $OUT/table.md
cat $S $OUT/table.md
grep -E "^(FAIL|thread)|panicked" $OUT/test-flash.log | head -10
echo "== sweep"; sed -n '/flash configurations/,$p' $OUT/attention-sweep-bthd.log | cut -c1-200
grep -E "^(pair|paird|pair8) " $OUT/attention-sweep-bthd.log | cut -c1-200
for f in $OUT/attention-bhtd.log $OUT/attention-bthd.log; do echo "== $f"; grep -E "^(d64|d128|qwen2|llama)|kernels:" $f | cut -c1-190; done
