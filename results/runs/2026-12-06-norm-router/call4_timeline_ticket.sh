#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for t in base new; do
  d=$ROOT; [ $t = base ] && d=$ROOT/.alt/base
  echo "=== $t"
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 200 python3 scripts/gpu/gpu_step_timeline.py --reps 10 2>&1 | grep -v "PyCUDA WARN" | tail -32)
done
