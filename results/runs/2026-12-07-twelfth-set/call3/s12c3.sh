#!/bin/bash
# hl (heads_fused: the row, the norm's weights and the angles loaded together) on top of tab; the working tree sent is hl's.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s12/tab; B=$PWD/.alt/s12/hl
diff -r kernels $B/kernels && echo "tree = hl"
echo "== heads/router probe"; timeout 60 python3 scripts/gpu/gpu_heads_router_bench.py 2>&1 | grep -v WARN | tee $OUT/heads_router.txt
echo "== ab tab hl"; timeout 200 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab_hl > $OUT/ab_hl.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_hl.txt | grep -E "DIFF|differ|full-size"; grep -c "same bits" $OUT/ab_hl.txt; date -u
echo "== cuda tests on hl"; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_hl.log 2>&1; echo rc=$?; tail -2 $OUT/test_cuda_hl.log; date -u
[ $SECONDS -lt 420 ] || exit 0
echo "== acceptance full on hl"; timeout $((590 - SECONDS)) python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.log 2>&1; echo acceptance rc=$?
grep -v "PyCUDA WARN" $OUT/acceptance.log | grep -E "^(PASS|FAIL)|floor|device time" | head -20; date -u
