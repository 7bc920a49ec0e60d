import re, sys
lines = open(sys.argv[1]).read().splitlines()
i = 0
while i < len(lines):
    m = re.match(r'\s*/\*([0-9a-f]{4})\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/', lines[i])
    if m:
        hi = int(re.search(r'/\* (0x[0-9a-f]+) \*/', lines[i+1]).group(1), 16)
        ctl = hi >> 41
        stall = ctl & 0xf; yld = (ctl >> 4) & 1; wb = (ctl >> 5) & 7; rb = (ctl >> 8) & 7; wm = (ctl >> 11) & 0x3f
        print(f"{m.group(1)} st{stall:2d} y{yld} wb{wb if wb!=7 else '-'} rb{rb if rb!=7 else '-'} w{wm:06b}  {m.group(2).strip()[:70]}")
        i += 2
    else:
        i += 1
