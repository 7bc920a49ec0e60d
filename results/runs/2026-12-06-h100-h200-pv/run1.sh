set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm --format=csv | tee $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
PYTHONPATH=/tmp/site:$M timeout 60 python3 scripts/gpu/gpu_serial_floor.py 2>&1 | tee $OUT/serial_floor.txt
bash .alt/pv.sh
acc() { d=$M; [ $1 != main ] && d=$M/.alt/$1
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/acc_$1_$2.json) > $OUT/acc_$1_$2.txt 2>&1
  echo "== $1 $2 $(date -u +%T)"; grep -E "^ *full 48L" $OUT/acc_$1_$2.txt | grep -v "finite\|one by one" | cut -c1-170; }
acc main 1; acc sfv3 1; acc early 1
(cd $M/.alt/sfv3 && PYTHONPATH=/tmp/site:$M/.alt/sfv3 timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "attention") > $OUT/test_attn_sfv3.txt 2>&1; echo "== test attention sfv3"; tail -2 $OUT/test_attn_sfv3.txt
E=$M/.alt/early
(cd $E && PYTHONPATH=/tmp/site:$E timeout 130 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda.py) > $OUT/test_cuda_early.txt 2>&1; echo "== test_cuda early"; tail -3 $OUT/test_cuda_early.txt
date -u
