#!/bin/bash
# every key of HEAD against b78964d (the base for item 5), then HEAD against eb6275e (rtr's A/B again, another machine)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u
mkdir -p /tmp/T/head && cp -r kestrel_tui kernels /tmp/T/head/
echo "== ab b78964d HEAD"; timeout 200 python3 scripts/gpu/gpu_same_bits.py --ab $PWD/.alt/b78 /tmp/T/head --pairs 1 --dir /tmp/ab_b78 > $OUT/ab_b78.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_b78.txt | grep -E "keys|DIFF|differ|full-size"; date -u
[ $SECONDS -lt 400 ] || exit 0
echo "== ab eb6275e HEAD"; timeout 180 python3 scripts/gpu/gpu_same_bits.py --ab $PWD/.alt/eb62 /tmp/T/head --pairs 2 --dir /tmp/ab_eb62 > $OUT/ab_eb62.txt 2>&1; echo rc=$?; grep -v WARN $OUT/ab_eb62.txt | grep -E "DIFF|differ|full-size"; grep -c "same bits" $OUT/ab_eb62.txt; date -u
