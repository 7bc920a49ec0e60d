"""A stand-in for the seed's C engine, run as its own OS process by the process-engine tests.

It decodes kestrel's embedded default model (2 layers) with the numpy sim
backend and appends each position's ``<key> <hash16>`` lines to the dump file
as it goes, flushing each line, like the seed's engine does. Env toggles pick
the exact ops (TOY_EXACT=norm,gemm | all | none, or TOY_<OP>_EXACT=1 per op);
with every op exact it is the cpu reference. ``--raw FILE`` appends a sidecar
record per buffer (written without kestrel's helper, to check the documented
format), before that key's dump line.

Test knobs: --sleep S per position, --fail-after N (exit 3 after position N),
--hang-after N, --partial-line (the last line without its "\\n"),
--spawn-child PIDFILE (leave a sleeping grandchild, its pid in PIDFILE),
--pid-file FILE (its own pid).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kestrel_tui, wherever the test runs us from

import numpy as np  # noqa: E402

from kestrel_tui.backends.toggles import TOGGLES  # noqa: E402
from kestrel_tui.session.inputs import default_prompt  # noqa: E402
from kestrel_tui.engines.build import make_backend  # noqa: E402
from kestrel_tui.engines.builtin import run_decode  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402

_DTYPE = {"float32": "f32", "int8": "i8", "int32": "i32", "float16": "f16", "uint8": "u8"}


def exact_ops() -> set[str]:
    spec = os.environ.get("TOY_EXACT", "")
    ops = set(TOGGLES) if spec == "all" else {s for s in spec.split(",") if s and s != "none"}
    ops |= {op for op in TOGGLES if os.environ.get(f"TOY_{op.upper()}_EXACT") == "1"}
    return ops


def ids(s: str | None) -> list[int] | None:
    return None if not s else [int(x) for x in s.split(",")]


def raw_record(tag: str, a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a).astype(np.dtype(a.dtype).newbyteorder("<"))
    shape = ",".join(map(str, a.shape or (1,)))
    return f"{tag} {_DTYPE[a.dtype.name]} {shape} {a.nbytes}\n".encode() + a.tobytes()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=os.environ.get("TOY_DUMP"))
    ap.add_argument("--raw", default=os.environ.get("TOY_RAW"))
    ap.add_argument("--prompt-ids")
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--forced-ids")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--fail-after", type=int)
    ap.add_argument("--hang-after", type=int)
    ap.add_argument("--partial-line", action="store_true")
    ap.add_argument("--spawn-child")
    ap.add_argument("--pid-file")
    ap.add_argument("--token-records", action="store_true", help="write t<T>_token records to the sidecar")
    a = ap.parse_args()
    if not a.dump:
        print("toy_engine: no dump file (--dump or TOY_DUMP)", file=sys.stderr)
        return 2
    if a.pid_file:
        Path(a.pid_file).write_text(str(os.getpid()))
    if a.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        Path(a.spawn_child).write_text(str(child.pid))
    model = load_model(None, n_layers=a.layers)
    prompt = ids(a.prompt_ids) or default_prompt(model.cfg.vocab, 4)
    backend = make_backend("sim", model, exact=frozenset(exact_ops()))
    dump = open(a.dump, "a", encoding="ascii")
    raw = open(a.raw, "ab") if a.raw else None
    P = len(prompt)

    def on_position(pos):
        items = list(pos.hashes.items())
        for i, (key, h) in enumerate(items):
            if raw is not None and pos.raw is not None and key in pos.raw:
                raw.write(raw_record(key, pos.raw[key]))
                raw.flush()  # before the key's dump line: the reader relies on that order
            last = i == len(items) - 1 and a.partial_line and pos.t == P + a.tokens - 1
            dump.write(f"{key} {h:016x}" + ("" if last else "\n"))
            dump.flush()
        if raw is not None and a.token_records:
            raw.write(raw_record(f"t{pos.t}_token", np.array([pos.token], dtype=np.int32)))
            raw.flush()
        if a.sleep:
            time.sleep(a.sleep)
        if a.fail_after is not None and pos.t == a.fail_after:
            print("toy_engine: starting to fail", file=sys.stderr)
            print(f"toy_engine: failing after position {pos.t} as asked", file=sys.stderr)
            sys.stderr.flush()
            os._exit(3)
        if a.hang_after is not None and pos.t == a.hang_after:
            time.sleep(3600)

    run_decode(backend, prompt, a.tokens, forced=ids(a.forced_ids), raw=raw is not None, on_position=on_position)
    dump.close()
    if raw is not None:
        raw.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
