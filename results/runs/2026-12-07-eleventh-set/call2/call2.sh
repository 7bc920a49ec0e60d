#!/bin/bash
# HEAD (rtr merged, top_k check): the acceptance sections, the cuda tests, then pfcls A/B on this HEAD
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u; git log --oneline -1 2>/dev/null
timeout 330 python3 scripts/gpu_acceptance.py --only full,bits,bench,profile,cli --replica-n 1000000 --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.log 2>&1; echo acceptance rc=$?
grep -v "PyCUDA WARN" $OUT/acceptance.log | grep -v "^ *$" | tail -60
date -u
timeout 160 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_head.log 2>&1; echo test_cuda head rc=$?; tail -2 $OUT/test_cuda_head.log
date -u
[ $SECONDS -lt 520 ] || exit 0
for v in head pfcls; do mkdir -p /tmp/T/$v && cp -r kestrel_tui kernels /tmp/T/$v/; done
cp .alt/pv/pfcls_head.cu /tmp/T/pfcls/kernels/attention.cu
echo "== ab head pfcls"; timeout $((590 - SECONDS)) python3 scripts/gpu/gpu_same_bits.py --ab /tmp/T/head /tmp/T/pfcls --pairs 2 --dir /tmp/ab_pfcls > $OUT/ab_pfcls.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_pfcls.txt | grep -E "DIFF|differ|full-size"; grep -c "same bits" $OUT/ab_pfcls.txt; date -u
