set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; H=$M/.alt/head
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
(PYTHONPATH=/tmp/site:$M timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py) > $OUT/test_cuda.txt 2>&1; echo "== test_cuda rc $? $(date -u +%T)"; tail -2 $OUT/test_cuda.txt
PYTHONPATH=/tmp/site:$H timeout 60 python3 $H/scripts/gpu/gpu_same_bits.py --out $OUT/before.json > $OUT/sb_log.txt 2>&1; echo "before rc $? $(date -u +%T)"
PYTHONPATH=/tmp/site:$M timeout 60 python3 scripts/gpu/gpu_same_bits.py --out $OUT/after.json >> $OUT/sb_log.txt 2>&1; echo "after rc $? $(date -u +%T)"
PYTHONPATH=/tmp/site:$M python3 scripts/gpu/gpu_same_bits.py --compare $OUT/before.json $OUT/after.json > $OUT/compare.txt; grep -c "same bits" $OUT/compare.txt; grep -v "same bits" $OUT/compare.txt
for r in 1 2; do for t in head main; do d=$H; [ $t = main ] && d=$M
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 45 python3 $M/.alt/ab.py $t) 2>&1 | tail -1 | tee -a $OUT/ab.txt
done; done
(PYTHONPATH=/tmp/site:$M timeout 60 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full.json) > $OUT/full.txt 2>&1; echo "== full rc $? $(date -u +%T)"; grep -E "^(PASS|FAIL)|device time" $OUT/full.txt | cut -c1-200
(PYTHONPATH=/tmp/site:$M timeout 30 python3 scripts/gpu/gpu_step_timeline.py --exact all --reps 10) > $OUT/timeline_all.txt 2>&1; echo "== timeline rc $?"; sed -n 3,16p $OUT/timeline_all.txt | cut -c1-100
date -u
