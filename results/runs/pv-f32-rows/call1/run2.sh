#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
mkdir -p /tmp/T/prod && cp -r kestrel_tui kernels /tmp/T/prod/
mkdir -p /tmp/T/prodsp && cp -r kestrel_tui kernels /tmp/T/prodsp/ && cp .alt/pv/prodsp.cu /tmp/T/prodsp/kernels/attention.cu && sed -i 's/^#define ATT_PV_THREADS (64 + ATT_PV_STAGE)/#define ATT_PV_THREADS 256/' /tmp/T/prodsp/kernels/launch.cuh && grep -n "ATT_PV_THREADS" /tmp/T/prodsp/kernels/launch.cuh
V="base=.alt/pv/base.cu prod=kernels/attention.cu vf32=.alt/pv/vf32.cu vf32c=.alt/pv/vf32c.cu vf32cl=.alt/pv/vf32cl.cu basecl=.alt/pv/basecl.cu vf32sp=.alt/pv/vf32sp.cu vf32spc=.alt/pv/vf32spc.cu base2=.alt/pv/base.cu prod2=kernels/attention.cu prodsp=.alt/pv/prodsp.cu"
for r in "" --rising; do echo "== bench $r"; timeout 70 python3 scripts/gpu/gpu_attn_bench.py $r $V 2>&1 | grep -v WARN; done | tee $OUT/attn_bench.txt
date -u
for v in .alt/pv/base.cu kernels/attention.cu .alt/pv/prodsp.cu; do echo "== trace $v"; timeout 30 python3 scripts/gpu/gpu_pv_trace.py 1024 $v 2>&1 | grep -v WARN | head -9; done | tee $OUT/trace.txt
date -u
pick() { grep "^$1 " $OUT/attn_bench.txt | head -1 | awk '{print $5}'; }
b=$(pick base); p=$(pick prod); b2=$(pick base2); p2=$(pick prod2); ps=$(pick prodsp)
echo "random: base $b / $b2, prod $p / $p2, prodsp $ps"
W=prod; if python3 -c "import sys; sys.exit(0 if $ps < min($p,$p2) - 0.3 else 1)"; then W=prodsp; cp -r /tmp/T/prodsp/kernels/* kernels/; fi
echo "winner $W"
if python3 -c "import sys; b=min($b,$b2); p=$ps if '$W' == 'prodsp' else max($p,$p2); sys.exit(0 if p < b - 0.3 else 1)"; then
  echo "== ab main $W"; timeout 200 python3 scripts/gpu/gpu_same_bits.py --ab .alt/trees/main /tmp/T/$W --pairs 2 --dir $OUT/ab 2>&1 | grep -v WARN | tee $OUT/ab.txt
  date -u
  timeout 90 python3 scripts/gpu_acceptance.py --only full --steps 30 --out $OUT/full_$W.json > $OUT/full_$W.log 2>&1; echo full $W rc=$?; grep -v "PyCUDA WARN" $OUT/full_$W.log | tail -10
  date -u
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUT/test_cuda_$W.log 2>&1; echo test_cuda $W rc=$?; tail -3 $OUT/test_cuda_$W.log
  date -u
else echo "prod not faster by 0.3 us: no full-size runs"; fi
