#!/bin/bash
# the acceptance on an H200: every bits section and the full-size rows, one process
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
timeout 570 python3 scripts/gpu_acceptance.py --only full,bits,bench,profile,cli --replica-n 1000000 --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.log 2>&1; echo acceptance rc=$?
grep -v "PyCUDA WARN" $OUT/acceptance.log | grep -v "^ *$" | tail -45
date -u
