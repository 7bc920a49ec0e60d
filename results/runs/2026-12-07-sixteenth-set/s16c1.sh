#!/bin/bash
# ncu stall sampling by SASS instruction of the exact P·V (head and pvc), then the acceptance on HEAD.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
H=$PWD; P=$PWD/.alt/s15/pvc
export PYTHONPATH=/tmp/site:$H
for v in head:$H pvc:$P; do
  n=${v%%:*}; t=${v#*:}
  for r in ""; do
    tag=$n${r:+_rising}
    timeout 120 $NCU --clock-control none -k regex:attn_exact_pv --launch-skip 5 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source yes \
      -f -o $OUT/$tag python3 .alt/run/pv_lineinfo.py $t $r x=$t/kernels/attention.cu > $OUT/$tag.log 2>&1; echo "$tag ncu rc=$?"
    tail -3 $OUT/$tag.log
    $NCU -i $OUT/$tag.ncu-rep --page source --csv --print-source sass > $OUT/${tag}_sass.csv 2>$OUT/${tag}_sass.err; echo "sass csv rc=$? $(wc -l < $OUT/${tag}_sass.csv)"
    $NCU -i $OUT/$tag.ncu-rep --page source --csv --print-source cuda,sass > $OUT/${tag}_cs.csv 2>>$OUT/${tag}_sass.err; echo "cuda,sass csv rc=$? $(wc -l < $OUT/${tag}_cs.csv)"
    $NCU -i $OUT/$tag.ncu-rep --page details --csv > $OUT/${tag}_details.csv 2>&1
    python3 .alt/run/stalls.py $OUT/${tag}_sass.csv --top 25 2>&1 | cut -c1-200 | head -40
  done
done; date -u
timeout 300 python3 scripts/gpu_acceptance.py --only full,bits --replica-n 1000000 --steps 30 --out $OUT/acceptance.json > $OUT/acceptance.txt 2>&1; echo rc=$?; grep -v WARN $OUT/acceptance.txt | grep -E "FAIL|PASS  full|full 48L|floor|bandwidth" | head -20; date -u
