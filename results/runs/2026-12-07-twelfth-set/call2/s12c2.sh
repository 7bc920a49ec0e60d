#!/bin/bash
# tab (the exponential's table copied to shared memory ahead of the wait: router, SwiGLU, exact P·V) against HEAD.
# The working tree sent is tab's.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s12/head; B=$PWD/.alt/s12/tab
diff -r kernels $B/kernels && echo "tree = tab"
echo "== heads/router probe"; timeout 60 python3 scripts/gpu/gpu_heads_router_bench.py 2>&1 | grep -v WARN | tee $OUT/heads_router.txt
echo "== attn bench"; timeout 60 python3 scripts/gpu/gpu_attn_bench.py head=$A/kernels/attention.cu tab=$B/kernels/attention.cu head2=$A/kernels/attention.cu tab2=$B/kernels/attention.cu 2>&1 | grep -v WARN | tee $OUT/attn_bench.txt
echo "== ab head tab"; timeout 260 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab_tab > $OUT/ab_tab.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_tab.txt | grep -E "DIFF|differ|full-size|device"; grep -c "same bits" $OUT/ab_tab.txt; date -u
echo "== cuda tests on tab"; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_tab.log 2>&1; echo rc=$?; tail -2 $OUT/test_cuda_tab.log; date -u
[ $SECONDS -lt 500 ] || exit 0
echo "== timeline tab exact"; timeout 80 python3 scripts/gpu/gpu_step_timeline.py --exact all > $OUT/timeline_tab_all.txt 2>&1; echo rc=$?; grep -v WARN $OUT/timeline_tab_all.txt | head -22
date -u
