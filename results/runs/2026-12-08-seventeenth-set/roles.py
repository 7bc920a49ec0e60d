import csv, sys
from collections import defaultdict
rows=list(csv.reader(open(sys.argv[1],errors='replace')))
h=rows[2]
reasons=[i for i,c in enumerate(h) if c.startswith('stall_') and 'Not Issued' not in c]
n=lambda x: float(x.replace(',','')) if x and x not in '-' else 0.0
def role(f, ln):
    if 'kernel.cu' not in f: return 'producers: expf and helpers (headers)'
    if 1041<=ln<=1050 or 990<=ln<=1015: return 'serial warps: loop'
    if ln in (1038,1039): return 'serial warps: waiting for the first stage'
    if ln in (1040,1057): return 'stage barrier (all warps)'
    if 940<=ln<=989 or ln in (1052,1053,1054,1055): return 'producers: loads and products'
    if 1058<=ln<=1070: return 'epilogue'
    if ln in (376,1029): return 'serial warps: T1 table to shared'
    if ln<400: return 'producers: expf (contract T1)'
    return 'prologue (pos0, prefetch, early loads, wait)'
by=defaultdict(lambda: defaultdict(float)); cur=None; fname=rows[0][1]
for r in rows[3:]:
    if not r: continue
    if r[0]=='File Path': fname=r[1]; continue
    if r[0] in ('Function Name','Line No'): continue
    if r[0]: cur=(fname,int(r[0])); continue
    g=role(*cur); by[g]['_s']+=n(r[4])
    for i in reasons: by[g][h[i][6:]]+=n(r[i])
tot=sum(v['_s'] for v in by.values()); print('total samples', tot)
for g,v in sorted(by.items(), key=lambda kv:-kv[1]['_s']):
    top=sorted(((x,k) for k,x in v.items() if not k.startswith('_')),reverse=True)[:6]
    print(f"{g:48} {int(v['_s']):5} ({100*v['_s']/tot:4.1f}%) | "+' '.join(f"{k}={x:.0f}" for x,k in top if x))
