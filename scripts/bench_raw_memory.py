"""Peak memory of a long foreign run with raw values: bounded by the raw store's budget.

Both sides are `process` engines running a synthetic writer that emits, per
position, 48 layers of Qwen3-30B-A3B-wide buffers (hidden 2048) with hashes and
a raw-values sidecar; the subject perturbs one layer so every later key is a
DIFF with raw values on both sides (the worst case for memory). The session
compares them and judges every DIFF key at the default tolerance. Run once per
budget in a fresh process; prints the peak RSS of this process (children
excluded) and how much was spilled to disk.

    python scripts/bench_raw_memory.py --positions 256 --budget-mib 256
    python scripts/bench_raw_memory.py --positions 256 --budget-mib 100000   # everything in memory
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_tui.session.session import RunSettings, Session  # noqa: E402
from kestrel_tui.engines.base import EngineSpec  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.trace import rawstore  # noqa: E402
from kestrel_tui.trace.compare import Tolerance  # noqa: E402

WRITER = textwrap.dedent('''
    import os, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from kestrel_tui.engines.sidecar import write_record
    from kestrel_tui.trace.fnv import fnv1a64
    from kestrel_tui.trace.keys import parse_key, token_keys
    n_pos, n_layers, hidden, vocab, bad_layer = map(int, sys.argv[2:7])
    rng = np.random.default_rng(0)
    with open(os.environ["DUMP"], "a") as dump, open(os.environ["RAW"], "ab") as raw:
        for t in range(n_pos):
            for key in token_keys(t, n_layers):
                a = rng.standard_normal(vocab if key.endswith("logits") else hidden).astype(np.float32)
                layer = parse_key(key).layer
                if bad_layer >= 0 and layer is not None and layer >= bad_layer:
                    a = a * np.float32(1.001)
                write_record(raw, key, a)
                raw.flush()
                dump.write(f"{key} {fnv1a64(a):016x}\\n")
                dump.flush()
''')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=256, help="decode positions (after a 16-token prompt)")
    ap.add_argument("--budget-mib", type=float, default=rawstore.DEFAULT_BUDGET / 2**20)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    rawstore.DEFAULT_BUDGET = int(args.budget_mib * 2**20)
    model = load_model(None)  # the embedded 48-layer default: the key set and the vocabulary
    cfg, prompt = model.cfg, list(range(16))
    n_pos = len(prompt) + args.positions
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        writer = Path(tmp) / "writer.py"
        writer.write_text(WRITER)

        def side(bad_layer: int):
            cmd = [sys.executable, str(writer), str(root), str(n_pos), str(cfg.n_layers), str(args.hidden),
                   str(cfg.vocab), str(bad_layer)]
            return make_engine(EngineSpec("process", options={"command": cmd, "dump_env": "DUMP", "raw_env": "RAW"}),
                               model)
        session = Session(model, prompt, args.positions, reference=side(-1), subject=side(cfg.n_layers // 2))
        t0 = time.perf_counter()
        res = session.run(RunSettings())
        summary = res.tolerance(Tolerance())
        wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    per_trace = [getattr(tr.store, "in_memory", 0) / 2**20 for tr in (res.ref, res.sub)]
    spilled = [getattr(tr.store, "on_disk", 0) / 2**20 for tr in (res.ref, res.sub)]
    print(f"{cfg.n_layers} layers x {n_pos} positions, hidden {args.hidden}: {len(res.comparison.status)} keys,"
          f" {summary.n_far} far, first far {summary.first_far}")
    print(f"raw budget {args.budget_mib:.0f} MiB per trace: in memory {per_trace[0]:.0f} + {per_trace[1]:.0f} MiB,"
          f" on disk {spilled[0]:.0f} + {spilled[1]:.0f} MiB")
    print(f"peak RSS {peak:.0f} MiB, wall {wall:.1f} s")


if __name__ == "__main__":
    main()
