#!/bin/bash
# the commit's acceptance: gpu_acceptance.py full and bits sections in one process, then the cuda tests
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
timeout 300 python3 scripts/gpu_acceptance.py --only full,bits --replica-n 1000000 --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.log 2>&1; echo acceptance rc=$?
grep -v "PyCUDA WARN" $OUT/acceptance.log | grep -E "^(PASS|FAIL)" | head -40; date -u
timeout $((560 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda.log 2>&1; echo test_cuda rc=$?; tail -2 $OUT/test_cuda.log; date -u
