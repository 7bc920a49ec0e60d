#!/bin/bash
# the target rows on whatever card comes; on an H200 the bits sections too
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
only=full; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && only=full,bits
timeout 200 python3 scripts/gpu_acceptance.py --only $only --replica-n 1000000 --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.log 2>&1; echo acceptance rc=$?
grep -v "PyCUDA WARN" $OUT/acceptance.log | grep -E "^(PASS|FAIL)|floor|device time" | head -40; date -u
