# next GPU stop: pv2warp (t5b) and pv2prod (t6) against main; outputs straight into $OUT (few files)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; export PYTHONPATH=/tmp/site:$M
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u; git log --oneline -1 | cut -c1-40
V="cur=kernels/attention.cu fv5b=.alt/pv4/fv5b.cu fv6=.alt/pv6/fv6.cu"
timeout 100 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | tee $OUT/bench.txt
timeout 100 python3 scripts/gpu/gpu_attn_bench.py --rising $V 2>&1 | tee $OUT/bench_rising.txt
for v in .alt/pv4/fv5b.cu .alt/pv6/fv6.cu; do echo "-- trace $v" >> $OUT/trace.txt; timeout 50 python3 scripts/gpu/gpu_pv_trace.py 1024 $v >> $OUT/trace.txt 2>&1; done; grep -A6 "^-- trace" $OUT/trace.txt | cut -c1-120
date -u
(cd .alt/t5b && PYTHONPATH=/tmp/site:$M/.alt/t5b timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py) > $OUT/test_t5b.txt 2>&1; echo "== test_cuda t5b rc $?"; tail -2 $OUT/test_t5b.txt
(cd .alt/t6 && PYTHONPATH=/tmp/site:$M/.alt/t6 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k attention) > $OUT/test_t6.txt 2>&1; echo "== test attention t6 rc $?"; tail -2 $OUT/test_t6.txt
date -u
