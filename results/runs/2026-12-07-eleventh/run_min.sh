#!/bin/bash
# the session's last machine time: the cuda tests on HEAD (bba1ad4's exact P·V), then its target rows
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_head.log 2>&1; echo test_cuda head rc=$?; tail -2 $OUT/test_cuda_head.log
date -u
timeout 80 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full_head.json > $OUT/full_head.log 2>&1; echo full head rc=$?; grep -v "PyCUDA WARN" $OUT/full_head.log | tail -8
date -u
