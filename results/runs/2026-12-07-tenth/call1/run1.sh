#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
for v in pf pfcl; do mkdir -p /tmp/T/$v && cp -r .alt/trees/main/kestrel_tui .alt/trees/main/kernels /tmp/T/$v/ && cp .alt/pv/$v.cu /tmp/T/$v/kernels/attention.cu; done
timeout 120 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full_main.json > $OUT/full_main.log 2>&1; echo full main rc=$?; grep -v "PyCUDA WARN" $OUT/full_main.log | tail -8
date -u
V="main=.alt/trees/main/kernels/attention.cu pf=.alt/pv/pf.cu pfcl=.alt/pv/pfcl.cu main2=.alt/trees/main/kernels/attention.cu pf2=.alt/pv/pf.cu"
for r in "" --rising; do echo "== bench $r"; timeout 40 python3 scripts/gpu/gpu_attn_bench.py $r $V 2>&1 | grep -v WARN; done | tee $OUT/attn_bench.txt
date -u
echo "== ab main pf"; timeout 150 python3 scripts/gpu/gpu_same_bits.py --ab .alt/trees/main /tmp/T/pf --pairs 2 --dir /tmp/ab_pf > $OUT/ab_pf.txt 2>&1; grep -v WARN $OUT/ab_pf.txt | grep -E "same|DIFF|differ|full-size"
date -u
rm -rf kestrel_tui kernels && cp -r .alt/trees/main/kestrel_tui .alt/trees/main/kernels .
for v in main pf main2 pf2; do
  if [[ $v == pf* ]]; then cp .alt/pv/pf.cu kernels/attention.cu; else cp .alt/trees/main/kernels/attention.cu kernels/attention.cu; fi
  timeout 60 python3 scripts/gpu/gpu_step_timeline.py --exact all > $OUT/timeline_$v.txt 2>&1; echo "== timeline $v rc=$?"
  grep -v WARN $OUT/timeline_$v.txt | grep -i -E "attn|stamp" | head -6
done
date -u
echo "== ab main pfcl"; timeout 150 python3 scripts/gpu/gpu_same_bits.py --ab .alt/trees/main /tmp/T/pfcl --pairs 2 --dir /tmp/ab_pfcl > $OUT/ab_pfcl.txt 2>&1; grep -v WARN $OUT/ab_pfcl.txt | grep -E "DIFF|differ|full-size"
date -u
