set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
M=$PWD; B=$M/.alt/before
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u; git log --oneline -1 | cut -c1-40
PYTHONPATH=/tmp/site:$B timeout 170 python3 $B/scripts/gpu/gpu_same_bits.py --out $OUT/before.json > $OUT/log.txt 2>&1; echo "before rc $? $(date -u +%T)"
PYTHONPATH=/tmp/site:$M timeout 170 python3 scripts/gpu/gpu_same_bits.py --out $OUT/after.json >> $OUT/log.txt 2>&1; echo "after rc $? $(date -u +%T)"
PYTHONPATH=/tmp/site:$B timeout 170 python3 $B/scripts/gpu/gpu_same_bits.py --out $OUT/before2.json >> $OUT/log.txt 2>&1; echo "before2 rc $? $(date -u +%T)"
PYTHONPATH=/tmp/site:$M python3 scripts/gpu/gpu_same_bits.py --compare $OUT/before.json $OUT/after.json | tee $OUT/compare.txt
PYTHONPATH=/tmp/site:$M python3 scripts/gpu/gpu_same_bits.py --compare $OUT/before2.json $OUT/after.json | tee $OUT/compare2.txt
tail -5 $OUT/log.txt; date -u
