#!/bin/bash
# On an H200: the acceptance (full,bits) on HEAD first. Then the warm, fine ncu of the exact P.V.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
if [[ "$GPU" == *H200* ]]; then
  timeout 330 python3 scripts/gpu_acceptance.py --only full,bits --replica-n 1000000 --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.log 2>&1; echo acceptance rc=$?
  grep -v "PyCUDA WARN" $OUT/acceptance.log | grep -v "^ *$" | tail -40; date -u
fi
left=$((570 - SECONDS)); echo "$left s left for ncu"; [ $left -gt 100 ] || exit 0
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout $((left - 40)) $NCU --clock-control none --cache-control none --warp-sampling-interval 0 -k regex:attn_exact_pv --launch-skip 5 --launch-count 3 \
  --section SourceCounters --section WarpStateStats -f -o /tmp/h0 python3 .alt/run/pv_lineinfo.py $PWD x=$PWD/kernels/attention.cu > $OUT/h0.log 2>&1; echo "ncu rc=$?"
$NCU -i /tmp/h0.ncu-rep --page source --csv --print-source cuda,sass > $OUT/h0_cs.csv 2>/dev/null; echo "csv rc=$? $(wc -l < $OUT/h0_cs.csv)"
$NCU -i /tmp/h0.ncu-rep --page details --csv > $OUT/h0_details.csv 2>&1
python3 .alt/run/roles.py $OUT/h0_cs.csv; date -u
