set -u
export TESTS="ops flash exec scratch" PROFILE=seed-llama REF_WORKLOADS="" PACK=0 TEST_TIMEOUT=150
bash bench/gpu-session.sh > $OUT/session.txt 2>&1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} RUMBLE_CUDA_CACHE=$PWD/.gpu/kcache
RUMBLE_FLASH_CFG=fa2 RUMBLE_ATTN_DUMP=/tmp/attn-fa2 timeout 120 .gpu/bin/attention-bench > $OUT/attention-fa2.log 2>&1
timeout 100 python3 bench/reference/attention_ref.py /tmp/attn-fa2 >> $OUT/attention-fa2.log 2>&1
timeout 120 .gpu/bin/matmul-bench > $OUT/matmul.log 2>&1
cp $RUMBLE_CUDA_CACHE/matmul-*.txt $OUT/ 2>/dev/null
cat $OUT/session.txt | tail -40
sed -n '/^attention fwd+bwd/,$p' $OUT/attention-fa2.log | head -20
cat $OUT/matmul.log
cd $OUT && tar czf /tmp/l.tgz --exclude=summary.txt --exclude=table.md . && find . -type f ! -name summary.txt ! -name table.md -delete && mv /tmp/l.tgz logs.tgz
