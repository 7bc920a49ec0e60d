#!/bin/bash
# pfcl (three A/Bs: exact device -0.027, -0.025, -0.027 ms) -> the cuda tests and the target rows;
# then, as time allows, pfcls (the prefetches issued by the serial warps instead of the producers)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
for v in pfcl pfcls; do mkdir -p /tmp/T/$v && cp -r .alt/trees/main/kestrel_tui .alt/trees/main/kernels /tmp/T/$v/ && cp .alt/pv/$v.cu /tmp/T/$v/kernels/attention.cu; done
rm -rf kestrel_tui kernels && cp -r /tmp/T/pfcl/kestrel_tui /tmp/T/pfcl/kernels .
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_pfcl.log 2>&1; echo test_cuda pfcl rc=$?; tail -2 $OUT/test_cuda_pfcl.log
date -u
timeout 70 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full_pfcl.json > $OUT/full_pfcl.log 2>&1; echo full pfcl rc=$?; grep -v "PyCUDA WARN" $OUT/full_pfcl.log | tail -8
date -u
[ $SECONDS -lt 175 ] || exit 0  # the machine time left
V="main=.alt/trees/main/kernels/attention.cu basecl=.alt/pv/basecl.cu pfcl=.alt/pv/pfcl.cu pfcls=.alt/pv/pfcls.cu pfs=.alt/pv/pfs.cu"
timeout 25 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | grep -v WARN | tee $OUT/attn_bench.txt
v=pfcls; echo "== ab main $v"; timeout 60 python3 scripts/gpu/gpu_same_bits.py --ab .alt/trees/main /tmp/T/$v --pairs 2 --dir /tmp/ab_$v > $OUT/ab_$v.txt 2>&1; grep -v WARN $OUT/ab_$v.txt | grep -E "DIFF|differ|full-size.*device"; grep -c "same bits" $OUT/ab_$v.txt; date -u
