set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; mkdir -p $OUT/d; export PYTHONPATH=/tmp/site:$M
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u; git log --oneline -1 | cut -c1-50
P=.alt/pv4; V="cur=.alt/pv/cur.cu fv3=.alt/pv/fv3.cu fv4=$P/fv4.cu fv4b=$P/fv4b.cu fv4p=$P/fv4p.cu fv4s=$P/fv4s.cu"
timeout 120 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | tee $OUT/d/bench.txt
timeout 120 python3 scripts/gpu/gpu_attn_bench.py --rising $V 2>&1 | tee $OUT/d/bench_rising.txt
for v in fv4 fv4b; do timeout 60 python3 scripts/gpu/gpu_pv_trace.py 1024 $P/$v.cu > $OUT/d/trace_$v.txt 2>&1; echo "-- trace $v"; sed -n 1,7p $OUT/d/trace_$v.txt; done
acc() { d=$M; [ $1 != main ] && d=$M/.alt/$1
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/d/acc_$1_$2.json) > $OUT/d/acc_$1_$2.txt 2>&1
  echo "== $1 $2 $(date -u +%T)"; grep -A12 "^=====" $OUT/d/acc_$1_$2.txt | grep -E "ms/token|hashing|bandwidth" | cut -c1-200; }
acc main 1; acc t4 1; acc t4b 1; acc main 2; acc t4 2; acc t4b 2
b4=$(awk '$1=="fv4"{print $6}' $OUT/d/bench.txt); b4b=$(awk '$1=="fv4b"{print $6}' $OUT/d/bench.txt)
W=t4; python3 -c "import sys; sys.exit(0 if float('$b4') <= float('$b4b') else 1)" || W=t4b
(cd .alt/$W && PYTHONPATH=/tmp/site:$M/.alt/$W timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k attention) > $OUT/d/test_attn_$W.txt 2>&1; echo "== test attention $W rc $?"; tail -2 $OUT/d/test_attn_$W.txt
date -u
tar czf $OUT/run4.tgz -C $OUT d && rm -rf $OUT/d
