#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
date -u
share() {
  echo "== $1 exact=$2"
  cd $ROOT/.alt/$1 && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/gpu/gpu_hash_share.py --exact $2 --reps 30 2>&1 | grep -E "^(nohash|all|body|logits) |^host|Error"
}
share base none; share early none; share base all; share early all; share base none; share early none
date -u
cd $ROOT/.alt/early && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -x tests/test_cuda.py -k "graph or hash" 2>&1 | tail -3
date -u
share base all; share early all
date -u
