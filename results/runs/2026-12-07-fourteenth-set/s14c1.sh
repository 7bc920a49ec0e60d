#!/bin/bash
# main's kernels on whatever card came: the acceptance (full, bits) first, then the cuda tests.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u; git log --oneline -1 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
echo "== acceptance full,bits"
timeout 300 python3 scripts/gpu_acceptance.py --only full,bits --replica-n 1000000 --steps 30 --out $RESULTS/acceptance.json > $RESULTS/acceptance.txt 2>&1; echo rc=$?; grep -v WARN $RESULTS/acceptance.txt | tail -40; date -u
left=$((${LIMIT:-580} - 10 - SECONDS)); echo "== cuda tests ($left s left)"
[ $left -gt 120 ] || { echo "too little time left"; exit 0; }
timeout $left python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $RESULTS/test_cuda.log 2>&1; echo rc=$?; tail -2 $RESULTS/test_cuda.log; date -u
