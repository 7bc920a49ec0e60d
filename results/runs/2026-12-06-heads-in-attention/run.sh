#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
date -u
timeout 300 python3 scripts/gpu/gpu_same_bits.py --ab BASE_TREE . --pairs 2 --dir $OUT/ab 2>&1 | tail -40
PYTHONPATH=/tmp/site:$ROOT timeout 170 python3 -m pytest -q tests/test_cuda.py -p no:cacheprovider 2>&1 | tail -4
for e in none all; do PYTHONPATH=/tmp/site:$ROOT timeout 60 python3 scripts/gpu/gpu_step_timeline.py --exact $e 2>&1 | tail -30; done
