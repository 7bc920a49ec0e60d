set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; B=$M/.alt/base
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
for e in none all; do
  (PYTHONPATH=/tmp/site:$M timeout 120 python3 scripts/gpu/gpu_step_timeline.py --exact $e --reps 20) > $OUT/timeline_$e.txt 2>&1; echo "== timeline $e rc $? $(date -u +%T)"; head -60 $OUT/timeline_$e.txt | cut -c1-120
done
acc() { d=$M; [ $1 = old ] && d=$B
  echo "== $1 $2 $(date -u +%T)" >> $OUT/acc.txt
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 scripts/gpu_acceptance.py --only full --steps 30) 2>&1 | grep -A12 "^=====" | grep -E "ms/token|hashing|bandwidth" | cut -c1-200 >> $OUT/acc.txt; }
acc old 1; acc new 1; acc old 2; acc new 2; cat $OUT/acc.txt
PYTHONPATH=/tmp/site:$B timeout 170 python3 $B/scripts/gpu/gpu_same_bits.py --out $OUT/before.json > $OUT/sb_log.txt 2>&1; echo "before rc $? $(date -u +%T)"
PYTHONPATH=/tmp/site:$M timeout 170 python3 scripts/gpu/gpu_same_bits.py --out $OUT/after.json >> $OUT/sb_log.txt 2>&1; echo "after rc $? $(date -u +%T)"
PYTHONPATH=/tmp/site:$M python3 scripts/gpu/gpu_same_bits.py --compare $OUT/before.json $OUT/after.json | tee $OUT/compare.txt | tail -25
date -u
