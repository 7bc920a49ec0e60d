echo "== pv"; V="cur=.alt/pv/cur.cu fv3=.alt/pv/fv3.cu sched=.alt/pv/sched.cu sfv3=.alt/pv/sched_fv3.cu"
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/gpu/gpu_attn_bench.py $V 2>&1 | tee $OUT/pv_bench.txt
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/gpu/gpu_attn_bench.py --rising $V 2>&1 | tee $OUT/pv_bench_rising.txt
for v in cur sched_fv3; do PYTHONPATH=/tmp/site:$PWD timeout 60 python3 scripts/gpu/gpu_pv_trace.py 1024 .alt/pv/$v.cu > $OUT/pv_trace_$v.txt 2>&1; echo "-- trace $v"; head -12 $OUT/pv_trace_$v.txt; done
which cuobjdump nvdisasm; for v in cur fv3; do cuobjdump -sass -fun attn_exact_pv_q8 .alt/pv/$v.cubin > $OUT/sass_$v.txt 2>&1 || nvdisasm .alt/pv/$v.cubin > $OUT/sass_$v.txt 2>&1; wc -l $OUT/sass_$v.txt; done
