#!/bin/bash
# dcl (down_combine loads its slots' weights and the residual with the GEMV's) against HEAD; then
# the cuda tests and the acceptance (full, bits) on the better tree.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s13/head; B=$PWD/.alt/s13/dcl
for t in $A $B; do cp -r scripts tests pyproject.toml .gpuref $t/; done
export PYTHONPATH=/tmp/site:$PWD
echo "== ab head dcl"; timeout 200 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab_dcl > $OUT/ab_dcl.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_dcl.txt | grep -E "DIFF|differ|full-size|Error|error" | head -30; grep -c "same bits" $OUT/ab_dcl.txt; date -u
W=$A; gain=$(grep -E "full-size (fast|exact) \(device\)" $OUT/ab_dcl.txt | sed -E 's/.*\(([-+]?[0-9.]+)\)$/\1/' | python3 -c "import sys; v=[float(x) for x in sys.stdin.read().split()]; print(1 if v and min(v) <= -0.01 and max(v) < 0.01 else 0)")
[ "$gain" = 1 ] && [ "$(grep -c "same bits" $OUT/ab_dcl.txt)" = 14 ] && W=$B; echo "tree for the rest: $W"
cd $W; export PYTHONPATH=/tmp/site:$W
if [ "$W" = "$B" ]; then echo "== cuda tests on dcl"; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_dcl.log 2>&1; echo rc=$?; tail -2 $OUT/test_cuda_dcl.log; date -u; fi
left=$((${LIMIT:-560} - 20 - SECONDS)); echo "== acceptance full,bits ($left s left)"
timeout $left python3 scripts/gpu_acceptance.py --only full,bits --replica-n 1000000 --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.txt 2>&1; echo rc=$?; grep -v WARN $OUT/acceptance.txt | tail -40; date -u
