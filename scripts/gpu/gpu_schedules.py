"""The cuda subject under every schedule against the cpu reference's decode, on the GPU.

    python3 scripts/gpu/gpu_schedules.py [N_LAYERS]

The embedded model (all 48 layers unless N_LAYERS), q4_0 and f32 weights, KV q8, an 8-token prompt and
6 teacher-forced tokens: every toggle exact, each schedule's keys and logits must equal the reference's
bit for bit (numerics.md G4); the fast kernels' first DIFF is printed beside it. The last line says
whether every exact schedule was bitwise.
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kestrel_tui.engines.base import EngineSpec, RunRequest  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.engines.builtin import OP_TOGGLES  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402

ok = True
for fmt in ("q4_0", "f32"):
    m = load_model(None, fmt, n_layers=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    prompt = [5, 77, 19, 33, 8, 9, 100, 3]
    ref = make_engine(EngineSpec("cpu"), m, kv="q8").run(RunRequest(prompt, 6, {}))
    forced = [p.token for p in ref.positions[len(prompt):]]
    ex = {t.name: t.exact for t in OP_TOGGLES}
    for s in ("decode", "forward", "chunked:3", "prefix:5", "verify:2", "verify:4"):
        t0 = time.time()
        e = make_engine(EngineSpec("cuda", options={"schedule": s}), m, kv="q8")
        tr = e.run(RunRequest(prompt, 6, ex, forced=forced if s != "decode" else None))
        d = [k for p, q in zip(ref.positions, tr.positions) for k in p.hashes if p.hashes[k] != q.hashes.get(k)]
        lg = all(np.array_equal(p.logits.view(np.uint32), q.logits.view(np.uint32)) for p, q in zip(ref.positions, tr.positions))
        fast = e.run(RunRequest(prompt, 6, {}, forced=forced))
        fd = next((k for p, q in zip(ref.positions, fast.positions) for k in p.hashes if p.hashes[k] != q.hashes.get(k)), None)
        print(f"{fmt} {s:10s} positions {len(tr.positions)} exact: diff keys {len(d)} logits bitwise {lg}; fast first DIFF {fd} ({time.time()-t0:.1f}s)", flush=True)
        ok &= (not d and lg and len(tr.positions) == len(ref.positions))
print("ALL EXACT SCHEDULES BITWISE" if ok else "MISMATCH")
