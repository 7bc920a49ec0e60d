#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for i in 1 2; do
  for t in base new; do
    d=$ROOT; [ $t = base ] && d=$ROOT/.alt/base
    (cd $d && PYTHONPATH=/tmp/site:$d timeout 100 python3 $ROOT/scripts/gpu/gpu_same_bits.py --out $OUT/$t$i.json 2>&1 | tail -1)
  done
done
for i in 1 2; do python3 scripts/gpu/gpu_same_bits.py --compare $OUT/base$i.json $OUT/new$i.json | grep -v "same bits$"; done
rm -f $OUT/base*.json $OUT/new*.json
PYTHONPATH=/tmp/site:$ROOT timeout 150 python3 -m pytest -q -x tests/test_cuda.py -p no:cacheprovider 2>&1 | tail -3

