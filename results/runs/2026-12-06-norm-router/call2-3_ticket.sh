#!/bin/bash
# call 1: the norm-router fusion: cuda tests, bits and device time against a75b15e, alternating
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ROOT=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null
for m in default 30b; do PYTHONPATH=/tmp/site:$ROOT timeout 100 python3 .alt/diag.py $m 2>&1 | grep -v 'PyCUDA WARN\|failed: an illegal' | tail -4; done
PYTHONPATH=/tmp/site:$ROOT timeout 240 python3 -m pytest -q -x tests/test_cuda.py -p no:cacheprovider 2>&1 | tail -4
for i in 1 2; do
  for t in base new; do
    d=$ROOT; [ $t = base ] && d=$ROOT/.alt/base
    (cd $d && PYTHONPATH=/tmp/site:$d timeout 150 python3 $ROOT/scripts/gpu/gpu_same_bits.py --out $OUT/$t$i.json 2>&1 | tail -2)
  done
done
for i in 1 2; do python3 scripts/gpu/gpu_same_bits.py --compare $OUT/base$i.json $OUT/new$i.json; done
