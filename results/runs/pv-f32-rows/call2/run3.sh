#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
rm -rf kestrel_tui kernels && cp -r .alt/trees/main/kestrel_tui .alt/trees/main/kernels . && cp .alt/pv/basecl.cu kernels/attention.cu
mkdir -p /tmp/T/cl && cp -r kestrel_tui kernels /tmp/T/cl/
V="base=.alt/pv/base.cu basecl=.alt/pv/basecl.cu basec=.alt/pv/basec.cu base2=.alt/pv/base.cu basecl2=.alt/pv/basecl.cu"
for r in "" --rising; do echo "== bench $r"; timeout 40 python3 scripts/gpu/gpu_attn_bench.py $r $V 2>&1 | grep -v WARN; done | tee $OUT/attn_bench.txt
date -u
echo "== ab main basecl"; timeout 200 python3 scripts/gpu/gpu_same_bits.py --ab .alt/trees/main /tmp/T/cl --pairs 2 --dir $OUT/ab 2>&1 | grep -v WARN | tee $OUT/ab.txt
date -u
timeout 90 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full_cl.json > $OUT/full_cl.log 2>&1; echo full cl rc=$?; grep -v "PyCUDA WARN" $OUT/full_cl.log | tail -10
date -u
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_cl.log 2>&1; echo test_cuda cl rc=$?; tail -3 $OUT/test_cuda_cl.log
date -u
echo "== trace basecl"; timeout 30 python3 scripts/gpu/gpu_pv_trace.py 1024 .alt/pv/basecl.cu 2>&1 | grep -v WARN | head -9 | tee $OUT/trace.txt
