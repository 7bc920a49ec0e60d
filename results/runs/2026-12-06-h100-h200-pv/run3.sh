set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/d
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u; git log --oneline -1 | cut -c1-60
D=.alt/diag; V="fv3=$D/fv3.cu noprod=$D/noprod.cu noserial=$D/noserial.cu noexp=$D/noexp.cu addonly=$D/addonly.cu nostore=$D/nostore.cu cur=.alt/pv/cur.cu"
timeout 120 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | tee $OUT/d/bench.txt
timeout 120 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | tee $OUT/d/bench2.txt
for v in fv3 noprod noserial noexp; do timeout 60 python3 scripts/gpu/gpu_pv_trace.py 1024 $D/$v.cu > $OUT/d/trace_$v.txt 2>&1; echo "-- trace $v"; sed -n 1,6p $OUT/d/trace_$v.txt; done
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/d/test_cuda_main.txt 2>&1; echo "== test_cuda main rc $?"; tail -3 $OUT/d/test_cuda_main.txt
date -u
tar czf $OUT/run3.tgz -C $OUT d && rm -rf $OUT/d
