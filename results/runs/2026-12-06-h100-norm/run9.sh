set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
for e in none all; do
  timeout 200 $NCU --profile-from-start off --graph-profiling node --cache-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/gpu/gpu_ncu_kernel_times.py run --exact $e > $OUT/ncu_$e.csv 2> $OUT/ncu_$e.err; echo "ncu $e rc $? $(date -u +%T)"
  python3 scripts/gpu/gpu_ncu_kernel_times.py summarize $OUT/ncu_$e.csv | tee $OUT/sum_$e.txt
done
tail -3 $OUT/ncu_all.err
