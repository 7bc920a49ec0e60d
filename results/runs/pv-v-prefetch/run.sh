#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
v=pf; mkdir -p /tmp/T/$v && cp -r .alt/trees/main/kestrel_tui .alt/trees/main/kernels /tmp/T/$v/ && cp .alt/pv/$v.cu /tmp/T/$v/kernels/attention.cu
echo "== ab main $v"; timeout 90 python3 scripts/gpu/gpu_same_bits.py --ab .alt/trees/main /tmp/T/$v --pairs 2 --dir /tmp/ab_$v 2>&1 | grep -v WARN | grep -E "same|DIFF|differ|full-size" | tee out/ab_$v.txt; date -u
d=$(grep "full-size exact (device)" out/ab_$v.txt | grep -o "([-+][0-9.]*)" | tr -d '()'); echo "$v exact device $d"
if python3 -c "import sys; sys.exit(0 if $d <= -0.012 else 1)"; then rm -rf kestrel_tui kernels && cp -r /tmp/T/$v/kestrel_tui /tmp/T/$v/kernels . && timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > out/test_cuda_$v.log 2>&1; echo test_cuda $v rc=$?; tail -2 out/test_cuda_$v.log; else echo "not beyond the spread: no test_cuda"; fi
date -u
