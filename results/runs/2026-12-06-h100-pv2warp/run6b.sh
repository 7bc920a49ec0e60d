# next GPU stop: pv2warp (t5b) and pv2prod (t6) against main; outputs straight into $OUT (few files)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; export PYTHONPATH=/tmp/site:$M
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u; git log --oneline -1 | cut -c1-40
acc() { d=$M; [ $1 != main ] && d=$M/.alt/$1
  echo "== $1 $2 $(date -u +%T)" >> $OUT/acc.txt
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 scripts/gpu_acceptance.py --only full --steps 30) 2>&1 | grep -A12 "^=====" | grep -E "ms/token|hashing|bandwidth" | cut -c1-200 >> $OUT/acc.txt; }
for i in 1 2; do for t in ${TREES:-main t5b t6}; do acc $t $i; done; done; cat $OUT/acc.txt
date -u
