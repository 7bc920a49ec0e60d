"""ncu's warp-state samples of attn_exact_pv_q8 by role and by SASS opcode, one table per launch.

    python3 pv_profile.py h0_cs.csv [--top 25] [--lines head|ab7]

h0_cs.csv is `ncu -i REPORT --page source --csv --print-source cuda,sass`. The page lists each
launch's instructions under its source lines, and lists an instruction twice within a launch, so
samples are counted once an address a launch. The roles are line ranges of
runtime.module_source("attention") for the version profiled (--lines).
"""
import argparse, csv, re
from collections import Counter, defaultdict

# line ranges of runtime.module_source("attention"): head = c99b665's kernels, ab7 = head + ab7.patch
LINES = {
    'head': dict(loop=((990, 1015), (1041, 1050)), first=(1038, 1039), barrier=(1040, 1057),
                 producers=((940, 989), (1052, 1055)), epilogue=(1058, 1070), table=(376, 1029)),
    'ab7': dict(loop=((1002, 1030), (1050, 1061)), first=(1047, 1048), barrier=(1049, 1072),
                producers=((940, 1000), (1062, 1071)), epilogue=(1073, 1090), table=(376, 1038)),
}

def role(fname, ln, m):
    inside = lambda spans: any(lo <= ln <= hi for lo, hi in spans)
    if 'kernel.cu' not in fname: return 'producers: expf helpers (headers)'
    if inside(m['loop']): return 'serial warps: the loop'
    if ln in m['first']: return 'serial warps: waiting for the first stage'
    if ln in m['barrier']: return 'the stage barrier (all warps)'
    if inside(m['producers']): return 'producers: loads and products'
    if inside((m['epilogue'],)): return 'epilogue'
    if ln in m['table']: return 'serial warps: T1 table to shared'
    if ln < 400: return 'producers: T1 expf'
    return 'prologue'

ap = argparse.ArgumentParser()
ap.add_argument('csv'); ap.add_argument('--top', type=int, default=25)
ap.add_argument('--lines', choices=LINES, default='head')
a = ap.parse_args()
rows = list(csv.reader(open(a.csv, errors='replace')))
head = rows[2]
reasons = [i for i, c in enumerate(head) if c.startswith('stall_') and 'Not Issued' not in c]
num = lambda x: float(x.replace(',', '')) if x and x != '-' else 0.0
launches, cur, fname, line = [], None, rows[0][1], None
for r in rows:
    if not r: continue
    if r[0] == 'File Path':
        fname = r[1]
        if 'kernel.cu' in fname: cur = {}; launches.append(cur)
        continue
    if r[0] in ('Function Name', 'Line No'): continue
    if r[0]: line = int(r[0]); continue
    if not r[2].startswith('0x') or cur is None: continue
    cur[int(r[2], 16)] = (role(fname, line, LINES[a.lines]), line, r[3].strip(), num(r[4]), num(r[7]),
                          {head[i][6:]: num(r[i]) for i in reasons if num(r[i])})
for k, ins in enumerate(launches):
    tot = sum(v[3] for v in ins.values())
    print(f'== launch {k + 1}: {int(tot)} samples')
    by, why = Counter(), defaultdict(Counter)
    for rl, ln, sass, s, ex, st in ins.values():
        by[rl] += s; why[rl].update(st)
    for rl, s in by.most_common():
        top = ' '.join(f'{r}={int(n)}' for r, n in why[rl].most_common(5))
        print(f'  {rl:44} {int(s):5} {100 * s / tot:5.1f} %  {top}')
    for want in ('serial warps: the loop', 'producers: loads and products'):
        ops, opwhy, opex = Counter(), defaultdict(Counter), Counter()
        for rl, ln, sass, s, ex, st in ins.values():
            if rl != want: continue
            op = re.sub(r'^@!?U?P\d\s+', '', sass).split()[0]
            ops[op] += s; opex[op] += ex; opwhy[op].update(st)
        print(f'  -- {want}, by opcode (samples, instructions executed, reasons)')
        for op, s in ops.most_common(12):
            print(f'     {op:16} {int(s):5} {int(opex[op]):8}  ' + ' '.join(f'{r}={int(n)}' for r, n in opwhy[op].most_common(4)))
    print(f'  -- the {a.top} instructions with the most samples')
    for addr, (rl, ln, sass, s, ex, st) in sorted(ins.items(), key=lambda kv: -kv[1][3])[:a.top]:
        print(f'     {addr & 0xffff:5x} L{ln:<5} {sass[:44]:44} {int(s):5} {int(ex):7}  ' + ' '.join(f'{r}={int(n)}' for r, n in Counter(st).most_common(3)))
