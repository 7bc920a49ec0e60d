#!/bin/bash
export PYTHONUNBUFFERED=1
[ -d /tmp/site/pycuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
ROOT=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
date -u
timeout 120 python3 .alt/pvloop/run.py 2>&1 | grep -v WARN | tee $OUT/pvloop.txt
date -u
for r in "" --rising; do timeout 80 python3 scripts/gpu/gpu_attn_bench.py $r base=.alt/pv/base.cu hoist=.alt/pv/hoist.cu prmt=.alt/pv/prmt.cu prod2=.alt/pv/prod2.cu combo=.alt/pv/combo.cu base2=.alt/pv/base.cu hoist2=.alt/pv/hoist.cu prmt2=.alt/pv/prmt.cu prod22=.alt/pv/prod2.cu combo2=.alt/pv/combo.cu 2>&1 | grep -v WARN | tee -a $OUT/attn_bench.txt; done
for v in base combo; do echo "== trace $v"; timeout 60 python3 scripts/gpu/gpu_pv_trace.py 1024 .alt/pv/$v.cu 2>&1 | grep -v WARN | head -14; done | tee $OUT/trace.txt
date -u
date -u
