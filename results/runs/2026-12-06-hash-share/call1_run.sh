#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
date -u
cd $ROOT/.alt/base
for ex in none all; do
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 scripts/gpu/gpu_hash_share.py --exact $ex --reps 30 2>&1 | tail -12
done
date -u
cd $ROOT
timeout 200 python3 scripts/gpu/gpu_same_bits.py --ab .alt/base .alt/prio --pairs 2 --dir $OUT/ab 2>&1 | tail -24
date -u
cd $ROOT/.alt/prio && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -x tests/test_cuda.py 2>&1 | tail -3
date -u
