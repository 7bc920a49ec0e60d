set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
for e in none all; do
  (PYTHONPATH=/tmp/site:$M timeout 100 python3 scripts/gpu/gpu_step_timeline.py --exact $e --reps 20) > $OUT/timeline_$e.txt 2>&1; echo "== timeline $e rc $? $(date -u +%T)"; head -40 $OUT/timeline_$e.txt | cut -c1-120
done
for r in 1 2 3; do for t in base vattn main; do d=$M/.alt/$t; [ $t = main ] && d=$M
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 60 python3 $M/.alt/ab.py $t) 2>&1 | tail -1 | tee -a $OUT/ab.txt
done; done
(PYTHONPATH=/tmp/site:$M timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py) > $OUT/test_cuda.txt 2>&1; echo "== test_cuda rc $? $(date -u +%T)"; tail -2 $OUT/test_cuda.txt
date -u
