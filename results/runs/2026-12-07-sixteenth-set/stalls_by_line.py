import csv, sys
from collections import defaultdict
rows=list(csv.reader(open(sys.argv[1],errors='replace')))
h=rows[2]; src=open(sys.argv[2]).read().split('\n')
ism=4; iex=7
reasons=[i for i,c in enumerate(h) if c.startswith('stall_') and 'Not Issued' not in c]
n=lambda x: float(x.replace(',','')) if x and x not in '-' else 0.0
by=defaultdict(lambda: defaultdict(float)); cur=None; fname=rows[0][1]
for r in rows[3:]:
    if not r: continue
    if r[0]=='File Path': fname=r[1]; continue
    if r[0] in ('Function Name','Line No'): continue
    if r[0]: cur=(fname,int(r[0])); continue
    s=n(r[ism]); by[cur]['_s']+=s; by[cur]['_n']+=1; by[cur]['_ex']=max(by[cur]['_ex'], n(r[iex]))
    for i in reasons: by[cur][h[i][6:]]+=n(r[i])
tot=sum(v['_s'] for v in by.values()); print('total',tot)
for (f,ln),v in sorted(by.items(), key=lambda kv:-kv[1]['_s'])[:int(sys.argv[3])]:
    top=sorted(((x,k) for k,x in v.items() if not k.startswith('_')),reverse=True)[:4]
    t=src[ln-1].strip()[:70] if 'kernel.cu' in f else f[-25:]
    print(f"{ln:5} {int(v['_s']):4} n={int(v['_n']):3} ex={int(v['_ex']):5} | {t:70} | "+' '.join(f"{k}={x:.0f}" for x,k in top if x))
