"""Summarize `ncu --page source --csv --print-source sass`: samples by instruction and by reason,
and totals over address ranges (--range NAME:FROM-TO, hex)."""
import argparse, csv, re, sys
from collections import defaultdict
ap = argparse.ArgumentParser(); ap.add_argument("csv"); ap.add_argument("--range", action="append", default=[])
ap.add_argument("--top", type=int, default=40)
a = ap.parse_args()
rows = list(csv.reader(open(a.csv, errors="replace")))
hi = next(i for i, r in enumerate(rows) if any("Address" in c for c in r))
head = rows[hi]; data = [r for r in rows[hi + 1:] if len(r) == len(head)]
print("columns:", head)
ia = next(i for i, c in enumerate(head) if "Address" in c); isrc = next(i for i, c in enumerate(head) if c.strip() == "Source")
num = lambda x: float(x.replace(",", "")) if re.fullmatch(r"[-0-9.,]+", x or "") else 0.0
scols = [i for i, c in enumerate(head) if "stall" in c.lower() or "Sampl" in c]
print("sample columns:", [head[i] for i in scols])
tot = defaultdict(float)
for r in data:
    for i in scols: tot[head[i]] += num(r[i])
print("totals:", dict(tot))
main = next((i for i in scols if "All Samples" in head[i] and "Not" not in head[i]), scols[0] if scols else None)
reasons = [i for i in scols if i != main and "Sampling" not in head[i]]
for r in sorted(data, key=lambda r: -num(r[main]))[:a.top]:
    br = sorted(((num(r[i]), head[i]) for i in reasons), reverse=True)[:3]
    print(f"{r[ia]:>8} {num(r[main]):7.0f}  {r[isrc][:60]:60}  " + "  ".join(f"{n}={v:.0f}" for v, n in br if v))
for spec in a.range:
    name, _, rg = spec.partition(":"); lo, hi2 = (int(x, 16) for x in rg.split("-"))
    sel = [r for r in data if lo <= int(r[ia], 16) <= hi2]
    agg = defaultdict(float)
    for r in sel:
        for i in scols: agg[head[i]] += num(r[i])
    print(name, len(sel), "instr:", {k: round(v) for k, v in sorted(agg.items(), key=lambda kv: -kv[1]) if v})
