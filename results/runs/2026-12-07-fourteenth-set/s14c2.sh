#!/bin/bash
# fc (the exact scores inside the P·V kernel, shared by a cluster of the head's 4 blocks) against HEAD:
# the kernel alone, its split-attention tests, then every key and the full-size speed.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s14/head; B=$PWD/.alt/s14/fc
for t in $A $B; do cp -r .gpuref $t/; done
export PYTHONPATH=/tmp/site:$PWD
echo "== attn bench"; for r in "" "--rising"; do timeout 120 python3 scripts/gpu/gpu_attn_bench.py $r head=$A/kernels/attention.cu fc=$B/kernels/attention.cu head2=$A/kernels/attention.cu fc2=$B/kernels/attention.cu 2>&1 | grep -v WARN | tail -6; done; date -u
echo "== split tests on fc"; (cd $B && PYTHONPATH=/tmp/site:$B timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "split_attention or several_attention" > $RESULTS/split_fc.log 2>&1; echo rc=$?; tail -3 $RESULTS/split_fc.log); date -u
grep -q "DIFFERS\|Error" $RESULTS/split_fc.log && { grep -E "Error|assert" $RESULTS/split_fc.log | head -20; }
echo "== ab head fc"; timeout 240 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab_fc > $RESULTS/ab_fc.txt 2>&1; echo rc=$?; grep -v WARN $RESULTS/ab_fc.txt | grep -E "DIFF|differ|full-size|Error|error" | head -30; grep -c "same bits" $RESULTS/ab_fc.txt; date -u
