set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
V="cur=kernels/attention.cu sched2=.alt/pv7/sched2.cu"
timeout 100 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | tee $OUT/bench.txt
timeout 100 python3 scripts/gpu/gpu_attn_bench.py --rising $V 2>&1 | tee $OUT/bench_rising.txt
timeout 100 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | tee $OUT/bench2.txt
timeout 50 python3 scripts/gpu/gpu_pv_trace.py 1024 .alt/pv7/sched2.cu > $OUT/trace.txt 2>&1; sed -n 1,8p $OUT/trace.txt | cut -c1-110
date -u
