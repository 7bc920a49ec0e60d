#!/bin/bash
# ring (a third stage buffer and named full/empty barriers in the exact P·V kernel) against HEAD:
# the kernel alone, its split-attention tests, every key and the full-size speed; the cuda tests if it gains.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s14/head; B=$PWD/.alt/s14/ring
for t in $A $B; do cp -r .gpuref $t/; done
cd $B; export PYTHONPATH=/tmp/site:$B
echo "== attn bench"; for r in "" "--rising"; do timeout 60 python3 scripts/gpu/gpu_attn_bench.py $r head=$A/kernels/attention.cu ring=$B/kernels/attention.cu head2=$A/kernels/attention.cu ring2=$B/kernels/attention.cu 2>&1 | grep -v WARN | tail -4; done; date -u
echo "== ab head ring"; timeout 170 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab_ring > $RESULTS/ab_ring.txt 2>&1; echo rc=$?; grep -v WARN $RESULTS/ab_ring.txt | grep -E "DIFF|differ|full-size|Error|error" | head -30; grep -c "same bits" $RESULTS/ab_ring.txt; date -u
gain=$(grep -E "full-size exact \(device\)" $RESULTS/ab_ring.txt | sed -E 's/.*\(([-+]?[0-9.]+)\)$/\1/' | python3 -c "import sys; v=[float(x) for x in sys.stdin.read().split()]; print(1 if v and v[0] <= -0.01 else 0)")
left=$((${LIMIT:-400} - SECONDS)); echo "gain=$gain, $left s left"
if [ "$gain" = 1 ] && [ "$(grep -c "same bits" $RESULTS/ab_ring.txt)" = 14 ] && [ $left -gt 100 ]; then
  timeout $((left - 5)) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $RESULTS/test_cuda_ring.log 2>&1; echo rc=$?; tail -2 $RESULTS/test_cuda_ring.log; grep -E "^E " $RESULTS/test_cuda_ring.log | head -8; date -u
elif [ $left -gt 90 ]; then
echo "== split tests on ring"; timeout $((left - 5)) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "split_attention or several_attention" > $RESULTS/split_ring.log 2>&1; echo rc=$?; tail -2 $RESULTS/split_ring.log; grep -E "^E " $RESULTS/split_ring.log | head -8; date -u
fi
