"""What the device scripts (gpu_acceptance.py, gpu_issue6.py) share: the result rows,
the JSON record, and a section runner that keeps going when one section crashes —
a device session is short and has to report everything it can."""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Callable

ROWS: list[tuple[str, str, str]] = []  # (check, figure, verdict)
RESULTS: dict = {}


def row(check: str, figure: str, ok: bool | None = None) -> None:
    verdict = "" if ok is None else ("PASS" if ok else "FAIL")
    ROWS.append((check, figure, verdict))
    print(f"  {verdict:4} {check}: {figure}", flush=True)


def run_sections(sections: dict[str, Callable], names: list[str], args, out: str, device: str) -> int:
    """Run the named sections in order, record their times, write `out` after each one,
    print the table of rows; exit status 1 if any row failed."""
    RESULTS["device"] = device
    print(f"device: {device}", flush=True)
    for name in names:
        print(f"== {name}", flush=True)
        t0 = time.time()
        try:
            sections[name](args)
        except Exception as e:
            traceback.print_exc()
            row(f"section {name}", f"crashed: {type(e).__name__}: {e}", False)
        RESULTS[f"section_{name}_s"] = time.time() - t0
        print(f"   ({name}: {time.time() - t0:.1f} s)", flush=True)
        Path(out).write_text(json.dumps(RESULTS, indent=1, default=str))
    print("\n" + "=" * 100)
    w = max((len(c) for c, _, _ in ROWS), default=0)
    for check, figure, verdict in ROWS:
        print(f"{verdict:4}  {check:<{w}}  {figure}")
    return 0 if all(v != "FAIL" for _, _, v in ROWS) else 1
