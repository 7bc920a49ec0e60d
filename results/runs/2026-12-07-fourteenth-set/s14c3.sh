#!/bin/bash
# Why fc is slower: the kernels alone (fc's bench, which runs either shape), and fc's full-size step
# with and without the P·V spread (one block an SM), in one process.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s14/head; B=$PWD/.alt/s14/fc
cd $B; export PYTHONPATH=/tmp/site:$B
echo "== attn bench (fc's script)"; for r in "" "--rising"; do timeout 100 python3 scripts/gpu/gpu_attn_bench.py $r head=$A/kernels/attention.cu fc=$B/kernels/attention.cu head2=$A/kernels/attention.cu fc2=$B/kernels/attention.cu 2>&1 | grep -v WARN | tail -5; done; date -u
echo "== fc spread on/off"; timeout 200 python3 scripts/gpu_options_ab.py spread= no-spread=pv_spread=off spread2= no-spread2=pv_spread=off --steps 20 2>&1 | grep -v WARN | tail -6; date -u
