#!/bin/bash
# HEAD (bba1ad4's exact P·V, pfcl): the cuda tests and the target rows first; on an H200 that is
# all (acc.sh next). Then, as the call's time allows: the exact router ranking by e under its
# ordered sum (rtr: .alt/trees/rtr, one warp more) against HEAD, and its cuda tests; then the
# serial warps' prefetch (pfcls: the P·V prefetches issued by the serial warps, idle before stage 0).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_head.log 2>&1; echo test_cuda head rc=$?; tail -2 $OUT/test_cuda_head.log
date -u
timeout 80 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full_head.json > $OUT/full_head.log 2>&1; echo full head rc=$?; grep -v "PyCUDA WARN" $OUT/full_head.log | tail -8
date -u
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && exit 0  # an H200: acc.sh next
for v in head pfcls; do mkdir -p /tmp/T/$v && cp -r kestrel_tui kernels /tmp/T/$v/; done
cp .alt/pv/pfcls_head.cu /tmp/T/pfcls/kernels/attention.cu
echo "== ab head rtr"; timeout 80 python3 scripts/gpu/gpu_same_bits.py --ab /tmp/T/head $PWD/.alt/trees/rtr --pairs 2 --dir /tmp/ab_rtr > $OUT/ab_rtr.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_rtr.txt | grep -E "DIFF|differ|full-size"; grep -c "same bits" $OUT/ab_rtr.txt; date -u
[ $SECONDS -lt 420 ] || exit 0
rm -rf kestrel_tui kernels && cp -r .alt/trees/rtr/kestrel_tui .alt/trees/rtr/kernels .
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_rtr.log 2>&1; echo test_cuda rtr rc=$?; tail -2 $OUT/test_cuda_rtr.log; date -u
rm -rf kestrel_tui kernels && cp -r /tmp/T/head/kestrel_tui /tmp/T/head/kernels .
[ $SECONDS -lt 470 ] || exit 0
timeout 25 python3 scripts/gpu/gpu_attn_bench.py head=kernels/attention.cu pfcls=.alt/pv/pfcls_head.cu 2>&1 | grep -v WARN | tee $OUT/attn_bench.txt
[ $SECONDS -lt 500 ] || exit 0
echo "== ab head pfcls"; timeout 80 python3 scripts/gpu/gpu_same_bits.py --ab /tmp/T/head /tmp/T/pfcls --pairs 2 --dir /tmp/ab_pfcls > $OUT/ab_pfcls.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_pfcls.txt | grep -E "DIFF|differ|full-size"; grep -c "same bits" $OUT/ab_pfcls.txt; date -u
