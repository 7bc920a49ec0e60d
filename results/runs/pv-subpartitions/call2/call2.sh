#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
V="base=.alt/sp/base.cu sp23=.alt/sp/sp23.cu sp23h=.alt/sp/sp23h.cu sp8=.alt/sp/sp8.cu base2=.alt/sp/base.cu sp232=.alt/sp/sp23.cu"
for r in "" --rising; do timeout 45 python3 scripts/gpu/gpu_attn_bench.py $r $V 2>&1 | grep -v WARN | tee -a $OUT/attn_bench.txt; done
date -u
for v in sp23 base; do echo "== trace $v"; timeout 25 python3 scripts/gpu/gpu_pv_trace.py 1024 .alt/sp/$v.cu 2>&1 | grep -v WARN | head -8; done | tee $OUT/trace.txt
date -u
