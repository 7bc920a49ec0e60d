"""Pick the variant to A/B at full size from gpu_attn_bench output (random, then rising)."""
import re, sys
runs = [l for l in open(sys.argv[1]) if " pv " in l]
t = {}
for l in runs:
    m = re.match(r"(\S+)\s+scores\s+\S+ us\s+pv\s+(\S+) us.*\)\s+(.*)", l.strip())
    lab = m.group(1).rstrip("2") if m.group(1) != "prod22" else "prod2"
    ok = "DIFF" not in m.group(3)
    t.setdefault(lab, []).append((float(m.group(2)), ok))
base = min(x for x, _ in t["base"])
best = None
for lab, xs in t.items():
    if lab == "base" or not all(ok for _, ok in xs):
        continue
    gain = base - min(x for x, _ in xs)
    if gain > 0.2 and (best is None or gain > best[1]):
        best = (lab, gain)
print(best[0] if best else "")
