set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; export PYTHONPATH=/tmp/site:$M
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
P=.alt/pv4; V="cur=.alt/pv/cur.cu fv3=.alt/pv/fv3.cu fv4p=$P/fv4p.cu fv5=$P/fv5.cu fv5b=$P/fv5b.cu"
timeout 100 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | tee $OUT/bench.txt
for v in fv5 fv5b; do timeout 50 python3 scripts/gpu/gpu_pv_trace.py 1024 $P/$v.cu > $OUT/trace_$v.txt 2>&1; echo "-- trace $v"; sed -n 1,6p $OUT/trace_$v.txt; done
timeout 100 python3 scripts/gpu/gpu_attn_bench.py --rising $V 2>&1 | tee $OUT/bench_rising.txt
(cd .alt/t5 && PYTHONPATH=/tmp/site:$M/.alt/t5 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k attention) > $OUT/test_attn_t5.txt 2>&1; echo "== test attention t5 rc $?"; tail -2 $OUT/test_attn_t5.txt
date -u
