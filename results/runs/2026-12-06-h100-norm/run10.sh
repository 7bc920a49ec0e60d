set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; O=$M/.alt/oldk
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
for i in 1 2; do
  echo "== old $i"; PYTHONPATH=/tmp/site:$O python3 $O/scripts/gpu/gpu_norm_bench.py 2>&1 | tail -5
  echo "== new $i"; PYTHONPATH=/tmp/site:$M python3 scripts/gpu/gpu_norm_bench.py 2>&1 | tail -5
done | tee $OUT/norm.txt
(PYTHONPATH=/tmp/site:$M timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py) > $OUT/test_cuda.txt 2>&1; echo "== test_cuda new rc $? $(date -u +%T)"; tail -2 $OUT/test_cuda.txt
acc() { d=$M; [ $1 = old ] && d=$O
  echo "== $1 $2 $(date -u +%T)" >> $OUT/acc.txt
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 scripts/gpu_acceptance.py --only full --steps 30) 2>&1 | grep -A12 "^=====" | grep -E "ms/token|hashing|bandwidth" | cut -c1-200 >> $OUT/acc.txt; }
acc old 1; acc new 1; acc old 2; acc new 2; cat $OUT/acc.txt
date -u
