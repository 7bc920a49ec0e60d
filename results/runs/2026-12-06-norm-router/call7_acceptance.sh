#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
git log --oneline -1 | cut -c1-60
timeout 250 python3 scripts/gpu_acceptance.py --only bits --out $OUT/bits.json > $OUT/bits.log 2>&1; echo bits rc=$?
timeout 200 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full.json > $OUT/full.log 2>&1; echo full rc=$?
grep -v "PyCUDA WARN" $OUT/bits.log | tail -30
grep -v "PyCUDA WARN" $OUT/full.log | tail -25
