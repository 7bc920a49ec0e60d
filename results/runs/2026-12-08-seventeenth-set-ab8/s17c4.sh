#!/bin/bash
# ab8 (the exact P.V producers' operands staged in shared memory by cp.async a stage ahead) against head:
# the kernel alone, every key and the full-size device time; the warm ncu of ab8; then test_cuda on ab8.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
ROOT=$PWD; A=$PWD/.alt/s17/head; B=$PWD/.alt/s17/ab8
for t in $A $B; do cp -r .gpuref $t/; done
cd $B; export PYTHONPATH=/tmp/site:$B
echo "== attn bench"; for r in "" "--rising"; do timeout 60 python3 scripts/gpu/gpu_attn_bench.py $r head=$A/kernels/attention.cu ab8=$B/kernels/attention.cu head2=$A/kernels/attention.cu ab82=$B/kernels/attention.cu 2>&1 | grep -v WARN | tail -5 | tee -a $OUT/bench.txt; done; date -u
echo "== ab head ab8"; timeout 220 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab > $OUT/ab.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab.txt | grep -E "DIFF|differ|device time|Error|error" | head -20; grep -c "same bits" $OUT/ab.txt; date -u
left=$((${LIMIT:-290} - SECONDS)); echo "cuda tests on ab8: $left s left"; [ $left -gt 60 ] || exit 0
timeout $left python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda.log 2>&1; echo "test_cuda rc=$?"; tail -2 $OUT/test_cuda.log; date -u
