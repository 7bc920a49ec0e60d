#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
for v in pfcl basecl; do mkdir -p /tmp/T/$v && cp -r .alt/trees/main/kestrel_tui .alt/trees/main/kernels /tmp/T/$v/ && cp .alt/pv/$v.cu /tmp/T/$v/kernels/attention.cu; done
for v in pfcl basecl pfcl; do echo "== ab main $v"; timeout 150 python3 scripts/gpu/gpu_same_bits.py --ab .alt/trees/main /tmp/T/$v --pairs 2 --dir /tmp/ab_$v > $OUT/ab_$v.txt 2>&1; grep -v WARN $OUT/ab_$v.txt | grep -E "DIFF|differ|full-size.*device"; date -u; done
rm -rf kestrel_tui kernels && cp -r .alt/trees/main/kestrel_tui .alt/trees/main/kernels .
for v in main pfcl basecl main2 pfcl2 basecl2; do
  case $v in pfcl*) cp .alt/pv/pfcl.cu kernels/attention.cu;; basecl*) cp .alt/pv/basecl.cu kernels/attention.cu;; *) cp .alt/trees/main/kernels/attention.cu kernels/attention.cu;; esac
  timeout 60 python3 scripts/gpu/gpu_step_timeline.py --exact all > /tmp/tl_$v.txt 2>&1; echo "== timeline $v rc=$?"
  grep -v WARN /tmp/tl_$v.txt | grep -i -E "attn|first to last" | head -4
done
date -u
