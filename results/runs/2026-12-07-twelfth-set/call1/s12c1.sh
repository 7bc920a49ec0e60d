#!/bin/bash
# diagnostics: the exact P·V producers' exponentials (attn bench variants), then exact's extra by toggle in the graph
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
for r in "" --rising; do
  echo "== attn bench $r"; timeout 90 python3 scripts/gpu/gpu_attn_bench.py base=.alt/s12/base.cu fastexp=.alt/s12/fastexp.cu noexp=.alt/s12/noexp.cu base2=.alt/s12/base.cu $r 2>&1 | grep -v WARN | tee -a $OUT/attn_bench.txt
done
date -u
ALL=norm,gemm,rope,expf,attention,kvquant,moe
for e in none $ALL gemm,rope,attention,kvquant,moe,norm norm,gemm,rope,expf,attention,kvquant gemm,rope,expf,attention,kvquant,moe norm,gemm,expf,attention,moe,rope; do
  echo "== timeline --exact $e"; timeout 100 python3 scripts/gpu/gpu_step_timeline.py --exact $e > $OUT/timeline_$e.txt 2>&1; echo rc=$?; grep -v WARN $OUT/timeline_$e.txt | head -40
  [ $SECONDS -lt 500 ] || exit 0
done; date -u
