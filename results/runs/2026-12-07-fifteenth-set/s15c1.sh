#!/bin/bash
# pvc (the exact P·V in chunks of 512, vv formed ahead of the wait, acc forming t itself) against HEAD:
# the kernel alone, every key and the full-size speed; the cuda tests if it gains, else its split tests.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; date -u
A=$PWD/.alt/s15/head; B=$PWD/.alt/s15/pvc; B2=$PWD/.alt/s15/pvc2
for t in $A $B $B2; do cp -r .gpuref $t/; done
cd $B; export PYTHONPATH=/tmp/site:$B
echo "== attn bench"; for r in "" "--rising"; do timeout 60 python3 scripts/gpu/gpu_attn_bench.py $r head=$A/kernels/attention.cu pvc=$B/kernels/attention.cu pvc2=$B2/kernels/attention.cu head2=$A/kernels/attention.cu pvc.=$B/kernels/attention.cu pvc2.=$B2/kernels/attention.cu 2>&1 | grep -v WARN | tail -6 | tee -a $RESULTS/bench.txt; done; date -u
timeout 60 python3 scripts/gpu/gpu_attn_bench.py --ctx 1500 --rising head=$A/kernels/attention.cu pvc=$B/kernels/attention.cu pvc2=$B2/kernels/attention.cu 2>&1 | grep -v WARN | tail -3
# the ab with pvc2 where it is bit-identical and faster alone by more than 0.2 us at 1024 (both orders)
pick=$(head -6 $RESULTS/bench.txt | python3 -c "
import sys,re
t={}
ok=True
for l in sys.stdin:
    m=re.match(r'(\S+)\s+scores\s+\S+ us\s+pv\s+(\S+) us.*\)\s+(.*)$', l.strip())
    if not m: continue
    k=m.group(1).rstrip('.'); t.setdefault(k,[]).append(float(m.group(2)))
    if k=='pvc2' and 'bit-identical' not in m.group(3): ok=False
a=sum(t.get('pvc',[0]))/max(1,len(t.get('pvc',[]))); b=sum(t.get('pvc2',[9e9]))/max(1,len(t.get('pvc2',[])))
print('pvc2' if ok and b < a - 0.2 else 'pvc')")
echo "ab with $pick"; [ "$pick" = pvc2 ] && B=$B2 && cd $B && export PYTHONPATH=/tmp/site:$B
echo "== ab head new"; timeout 200 python3 scripts/gpu/gpu_same_bits.py --ab $A $B --pairs 2 --dir /tmp/ab > $RESULTS/ab.txt 2>&1; echo rc=$?; grep -v WARN $RESULTS/ab.txt | grep -E "DIFF|differ|full-size|Error|error" | head -30; grep -c "same bits" $RESULTS/ab.txt; date -u
left=$((${LIMIT:-560} - SECONDS)); echo "$left s left"
if [ $left -gt 170 ]; then
  timeout $((left - 5)) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > $RESULTS/test_cuda.log 2>&1; echo rc=$?; tail -2 $RESULTS/test_cuda.log; grep -E "^E " $RESULTS/test_cuda.log | head -8; date -u
elif [ $left -gt 60 ]; then
  timeout $((left - 5)) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "split_attention or several_attention" > $RESULTS/split.log 2>&1; echo rc=$?; tail -2 $RESULTS/split.log; grep -E "^E " $RESULTS/split.log | head -8; date -u
fi
left=$((${LIMIT:-560} - SECONDS)); [ $left -gt 40 ] && for t in $A $B; do timeout 30 python3 scripts/gpu/gpu_pv_trace.py 1024 $t/kernels/attention.cu 2>&1 | grep -v WARN | head -14; done
