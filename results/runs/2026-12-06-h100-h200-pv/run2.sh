set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; mkdir -p $OUT/d
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
cuobjdump -sass .alt/pv/fv3.cubin > $OUT/d/sass_fv3.txt 2>&1; cuobjdump -sass .alt/pv/cur.cubin > $OUT/d/sass_cur.txt 2>&1
acc() { d=$M; [ $1 != main ] && d=$M/.alt/$1
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/d/acc_$1_$2.json) > $OUT/d/acc_$1_$2.txt 2>&1
  echo "== $1 $2 $(date -u +%T)"; grep -A12 "^=====" $OUT/d/acc_$1_$2.txt | grep -E "ms/token|hashing|bandwidth" | cut -c1-200; }
acc early 1; acc main 1; acc early 2; acc main 2; acc early 3; acc main 3
E=$M/.alt/early
(cd $E && PYTHONPATH=/tmp/site:$E timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py) > $OUT/d/test_cuda_early.txt 2>&1; echo "== test_cuda early rc $?"; tail -5 $OUT/d/test_cuda_early.txt
date -u
tar czf $OUT/run2.tgz -C $OUT d && rm -rf $OUT/d
