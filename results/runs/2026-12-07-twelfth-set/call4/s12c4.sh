#!/bin/bash
# rd (exact router: p only for the first k + 1 in e's order) on top of da584f8; the working tree sent is rd's
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s12/h2; B=$PWD/.alt/s12/rd
diff -r kernels $B/kernels && echo "tree = rd"
echo "== heads/router probe"; timeout 60 python3 scripts/gpu/gpu_heads_router_bench.py --reps 100 2>&1 | grep -v WARN | grep -v "heads" | tee $OUT/router_probe.txt
echo "== ab h2 rd"; timeout 200 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab_rd > $OUT/ab_rd.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_rd.txt | grep -E "DIFF|differ|full-size"; grep -c "same bits" $OUT/ab_rd.txt; date -u
echo "== cuda tests on rd"; timeout 190 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_rd.log 2>&1; echo rc=$?; tail -3 $OUT/test_cuda_rd.log; grep -E "FAIL|Error" $OUT/test_cuda_rd.log | head; date -u
[ $SECONDS -lt 400 ] || exit 0
echo "== acceptance full on rd"; timeout $((590 - SECONDS)) python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.log 2>&1; echo acceptance rc=$?
grep -v "PyCUDA WARN" $OUT/acceptance.log | grep -E "^(PASS|FAIL)|floor|device time" | head -20; date -u
