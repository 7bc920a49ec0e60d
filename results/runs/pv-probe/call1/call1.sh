#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
date -u
for v in base combo; do mkdir -p /tmp/T/$v && cp -r kestrel_tui kernels /tmp/T/$v/ && cp .alt/pv/$v.cu /tmp/T/$v/kernels/attention.cu; done
echo "== attn bench"; for r in "" --rising; do timeout 70 python3 scripts/gpu/gpu_attn_bench.py $r base=.alt/pv/base.cu hoist=.alt/pv/hoist.cu prmt=.alt/pv/prmt.cu prod2=.alt/pv/prod2.cu combo=.alt/pv/combo.cu base2=.alt/pv/base.cu combo2=.alt/pv/combo.cu 2>&1 | grep -v WARN | tee -a $OUT/attn_bench.txt; done
date -u
echo "== ab base combo"; timeout 150 python3 scripts/gpu/gpu_same_bits.py --ab /tmp/T/base /tmp/T/combo --pairs 2 --dir $OUT/ab 2>&1 | grep -v WARN | tee $OUT/ab.txt
date -u
for v in base combo; do cp .alt/pv/$v.cu kernels/attention.cu; timeout 80 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full_$v.json > $OUT/full_$v.log 2>&1; echo full $v rc=$?; grep -v "PyCUDA WARN" $OUT/full_$v.log | tail -8; done
date -u
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_combo.log 2>&1; echo test_cuda combo rc=$?; tail -3 $OUT/test_cuda_combo.log
cp .alt/pv/base.cu kernels/attention.cu
date -u
timeout 60 python3 .alt/pvloop/run.py 2>&1 | grep -v WARN | tee $OUT/pvloop.txt
for v in base combo; do echo "== trace $v"; timeout 30 python3 scripts/gpu/gpu_pv_trace.py 1024 .alt/pv/$v.cu 2>&1 | grep -v WARN | head -14; done | tee $OUT/trace.txt
date -u
