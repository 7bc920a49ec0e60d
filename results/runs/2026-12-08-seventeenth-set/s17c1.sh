#!/bin/bash
# gated (the exact P·V's rescale batches multiply only in their groups of 8 with a c != 1) against head:
# the kernel alone (random and rising scores), every key and the full-size device time; then the warm ncu of head.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
ROOT=$PWD; A=$PWD/.alt/s16/head; B=$PWD/.alt/s16/gated
for t in $A $B; do cp -r .gpuref $t/; done
cd $B; export PYTHONPATH=/tmp/site:$B
echo "== attn bench"; for r in "" "--rising"; do timeout 60 python3 scripts/gpu/gpu_attn_bench.py $r head=$A/kernels/attention.cu gated=$B/kernels/attention.cu head2=$A/kernels/attention.cu gated2=$B/kernels/attention.cu 2>&1 | grep -v WARN | tail -5 | tee -a $OUT/bench.txt; done; date -u
echo "== ab head gated"; timeout 220 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab > $OUT/ab.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab.txt | grep -E "DIFF|differ|device time|Error|error" | head -20; grep -c "same bits" $OUT/ab.txt; date -u
echo "== split tests on gated"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "split_attention or several_attention" > $OUT/split.log 2>&1; echo rc=$?; tail -2 $OUT/split.log; date -u
cd $A; export PYTHONPATH=/tmp/site:$A
left=$((${LIMIT:-560} - SECONDS)); echo "$left s left"; [ $left -gt 90 ] || exit 0
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout $((left - 30)) $NCU --clock-control none --cache-control none --warp-sampling-interval 0 -k regex:attn_exact_pv --launch-skip 5 --launch-count 3 \
  --section SourceCounters --section WarpStateStats -f -o /tmp/h0 python3 $ROOT/.alt/run/pv_lineinfo.py $A x=$A/kernels/attention.cu > $OUT/h0.log 2>&1; echo "ncu rc=$?"
$NCU -i /tmp/h0.ncu-rep --page source --csv --print-source cuda,sass > $OUT/h0_cs.csv 2>/dev/null; echo "csv rc=$? $(wc -l < $OUT/h0_cs.csv)"
python3 $ROOT/.alt/run/roles.py $OUT/h0_cs.csv; date -u
