set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1); echo "nsys: $NSYS"
for e in none all; do
  [ -n "$NSYS" ] || break
  timeout 150 $NSYS profile --capture-range=cudaProfilerApi --capture-range-end=stop --cuda-graph-trace=node --trace=cuda -f true -o $OUT/tl_$e python3 scripts/gpu/gpu_ncu_kernel_times.py run --exact $e --reps 3 > $OUT/nsys_$e.log 2>&1; echo "== nsys $e rc $? $(date -u +%T)"
  timeout 120 $NSYS stats -r cuda_gpu_trace -f csv -o $OUT/tl_$e $OUT/tl_$e.nsys-rep >> $OUT/nsys_$e.log 2>&1; echo "== stats rc $?"; rm -f $OUT/tl_$e.sqlite
  ls -la $OUT | head
done
(timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py) > $OUT/test_cuda.txt 2>&1; echo "== test_cuda rc $? $(date -u +%T)"; tail -2 $OUT/test_cuda.txt
(timeout 150 python3 scripts/gpu_acceptance.py --only bits --out $OUT/bits.json) > $OUT/bits.txt 2>&1; echo "== bits rc $? $(date -u +%T)"; grep -c PASS $OUT/bits.txt; grep -E "FAIL" $OUT/bits.txt | head
date -u
