#!/bin/bash
# fz (the exact attention's scores inside the P.V kernel: scorer warps two stages ahead) against HEAD.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s13/head; B=$PWD
echo "== split attention test"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "split_attention" > $OUT/t_split.log 2>&1; echo rc=$?; tail -15 $OUT/t_split.log; date -u
echo "== attn bench"; timeout 90 python3 scripts/gpu/gpu_attn_bench.py head=$A/kernels/attention.cu fz=$B/kernels/attention.cu head2=$A/kernels/attention.cu fz2=$B/kernels/attention.cu 2>&1 | grep -v WARN | tee $OUT/attn_bench.txt
echo "== ab head fz"; timeout 260 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab_fz > $OUT/ab_fz.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_fz.txt | grep -E "DIFF|differ|full-size|device|Error|error" | head -30; grep -c "same bits" $OUT/ab_fz.txt; date -u
[ $SECONDS -lt 380 ] || exit 0
echo "== cuda tests on fz"; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_fz.log 2>&1; echo rc=$?; tail -3 $OUT/test_cuda_fz.log; date -u
[ $SECONDS -lt 500 ] || exit 0
echo "== timeline fz exact"; timeout 80 python3 scripts/gpu/gpu_step_timeline.py --exact all > $OUT/timeline_fz_all.txt 2>&1; echo rc=$?; grep -v WARN $OUT/timeline_fz_all.txt | head -24
date -u
