#!/bin/bash
# Diagnostic: fc with the loop's cluster arrival relaxed (no MEMBAR.ALL.GPU a stage), the kernels alone.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s14/head; B=$PWD/.alt/s14/fc; C=$PWD/.alt/s14/fcr
cd $B; export PYTHONPATH=/tmp/site:$B
for r in "" "--rising"; do timeout 100 python3 scripts/gpu/gpu_attn_bench.py $r head=$A/kernels/attention.cu fc=$B/kernels/attention.cu fcr=$C/kernels/attention.cu head2=$A/kernels/attention.cu fc2=$B/kernels/attention.cu fcr2=$C/kernels/attention.cu 2>&1 | grep -v WARN | tail -6; done; date -u
for T in 128 4096; do timeout 100 python3 scripts/gpu/gpu_attn_bench.py --ctx $T head=$A/kernels/attention.cu fc=$B/kernels/attention.cu fcr=$C/kernels/attention.cu 2>&1 | grep -v WARN | tail -3; done; date -u
