#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
git log --oneline -1 | cut -c1-60; date -u
timeout 200 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full.json > $OUT/full.log 2>&1; echo full rc=$?
date -u
timeout 240 python3 scripts/gpu_acceptance.py --only bits --out $OUT/bits.json > $OUT/bits.log 2>&1; echo bits rc=$?
date -u
timeout 150 python3 -m pytest -q tests/test_cuda.py > $OUT/test_cuda.log 2>&1; echo test_cuda rc=$?
date -u
grep -v "PyCUDA WARN" $OUT/full.log | tail -25
grep -c "^PASS" $OUT/bits.log; grep "^FAIL" $OUT/bits.log | head
tail -3 $OUT/test_cuda.log
