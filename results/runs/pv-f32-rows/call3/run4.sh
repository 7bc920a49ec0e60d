#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
rm -rf kestrel_tui kernels && cp -r .alt/trees/main/kestrel_tui .alt/trees/main/kernels .
for v in main cl main2 cl2; do
  if [[ $v == cl* ]]; then cp .alt/pv/basecl.cu kernels/attention.cu; else cp .alt/trees/main/kernels/attention.cu kernels/attention.cu; fi
  timeout 100 python3 scripts/gpu/gpu_step_timeline.py --exact all > $OUT/timeline_$v.txt 2>&1; echo "== $v rc=$?"
  grep -v WARN $OUT/timeline_$v.txt | grep -i -E "replay|attn|in all|total|stamp" | head -14
  date -u
done
