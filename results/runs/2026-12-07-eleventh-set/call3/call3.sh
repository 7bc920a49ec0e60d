#!/bin/bash
# HEAD (rtr merged): each kernel's share of a graph replay, fast and exact, twice each alternating
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
for r in 1 2; do for e in none all; do
  echo "== timeline --exact $e ($r)"; timeout 100 python3 scripts/gpu/gpu_step_timeline.py --exact $e > $OUT/timeline_${e}_$r.txt 2>&1; echo rc=$?; grep -v WARN $OUT/timeline_${e}_$r.txt | head -40
  [ $SECONDS -lt 480 ] || exit 0
done; done; date -u
