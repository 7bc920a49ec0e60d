"""Export snapshots: each in a folder of its own that did not exist before, whole or marked unfinished.

A snapshot is evidence, so nothing here ever replaces a file. The folder is
built as ``<stamp>-<n>.partial`` (created exclusively, and only for an n whose
finished name does not exist either) and renamed to ``<stamp>-<n>`` once every
file is in, so a folder without the suffix is always complete; an export that
fails part way stays ``.partial`` (files.py marks a half-written file the same
way). Every file is written with files.create_whole. Contents: both dump files
in the L2 format, report.json, and the SVG screenshot, which the app takes on
the UI thread and hands over as text (the files are written in a worker).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from ..session.session import HistoryEntry, RunResult, Session
from ..errors import UsageError
from ..files import PARTIAL_SUFFIX, create_whole
from ..trace.compare import Comparison, DiffStats, Status
from ..trace.dump import write_dump

SCREENSHOT = "screenshot.svg"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kestrel-tui")
    except PackageNotFoundError:
        return "unknown"

REPORT = "report.json"


def new_export_dir(root: str | Path, now: datetime | None = None) -> Path:
    """root/<YYYYmmdd-HHMMSS>-<n>.partial, the first n free under both names; publish() finishes it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    n = 1
    while True:
        final = root / f"{stamp}-{n}"
        n += 1
        if final.exists():
            continue
        try:
            partial = final.with_name(final.name + PARTIAL_SUFFIX)
            partial.mkdir()  # atomic: two exports in the same second get different folders
            return partial
        except FileExistsError:  # taken, or left by an export that failed: never reused
            continue


def final_name(folder: Path) -> Path:
    """Where an export folder being built will be once it is whole."""
    return folder.with_name(folder.name.removesuffix(PARTIAL_SUFFIX))


def publish(folder: Path) -> Path:
    """Give a filled <name>.partial folder its finished name; never onto anything that holds files.

    rename(2) fails on a non-empty target; an empty folder of that name made by
    someone else in the moment since the check holds nothing to lose.
    """
    final = final_name(folder)
    if final.exists():
        raise UsageError(f"{final}: appeared while the export was written; it is kept as {folder}")
    os.rename(folder, final)
    return final


def write_screenshot(folder: Path, svg: str) -> None:
    with create_whole(folder / SCREENSHOT, what="screenshot") as f:
        f.write(svg)


def _finite(x):
    # JSON has no NaN/inf; keep them readable as strings instead of producing invalid JSON
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def json_safe(x):
    """`x` (dicts, lists, numbers) with every non-finite float written as a string: JSON has no NaN."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return _finite(x)


def stats_json(s: DiffStats) -> dict:
    return {"n": s.n, "n_diff": s.n_diff, "n_nan": s.n_nan, "max_ulp": s.max_ulp,
            "max_abs_err": _finite(s.max_abs_err), "first_index": s.first_index,
            "first_a": _finite(s.first_a), "first_b": _finite(s.first_b)}


def history_json(entries: list[HistoryEntry]) -> list[dict]:
    return [{"change": e.change, "before": e.before, "after": e.after, "exact": sorted(e.settings.exact),
             "line": e.line()} for e in entries]


def _write_json(path: Path, data: dict) -> None:
    with create_whole(path, what="report") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _counts(cmp: Comparison) -> dict[str, int]:
    return {st.value: n for st, n in cmp.counts.items()}


def write_live(folder: Path, session: Session, result: RunResult, *, device: str, note: str | None) -> Path:
    """reference.dump, subject.dump and report.json for one finished run."""
    write_dump(folder / "reference.dump", ((k, h) for p in result.ref.positions for k, h in p.hashes.items()))
    write_dump(folder / "subject.dump", ((k, h) for p in result.sub.positions for k, h in p.hashes.items()))
    cmp = result.comparison
    stats = {}
    for key, st in cmp.status.items():
        if st is Status.DIFF:
            s = result.stats(key)
            stats[key] = stats_json(s) if s is not None else None
    cfg, model = session.model.cfg, session.model
    settings = result.settings
    report = {
        "kestrel_tui": _version(),
        "created": datetime.now().isoformat(timespec="seconds"),
        "model": {"name": model.name, "arch": cfg.arch, "n_layers": cfg.n_layers, "hidden": cfg.hidden,
                  "vocab": cfg.vocab, "weights": model.fmt, "kv": session.kv, "deep": session.deep},
        "prompt": list(session.prompt),
        "n_tokens": session.n_tokens,
        "reference": result.ref.backend,
        "subject": result.sub.backend,
        "device": device,
        "note": note,
        "settings": {"exact": sorted(settings.exact), "mode": settings.mode, "prefill": settings.prefill,
                     "forcing": settings.forcing, "label": session.label(settings)},
        "toggles": settings.values(session.toggles),
        "notes": list(result.notes),
        "first_diff": cmp.first_diff,
        "first_mismatch": cmp.first_mismatch,
        "all_ok": result.all_ok,
        "counts": _counts(cmp),
        "tokens": [{"t": s.t, "prompt": s.prompt, "ref_top1": s.ref_top1, "sub_top1": s.sub_top1,
                    "flip": s.flip, "n_diff": s.n_diff} for s in result.tokens],
        "history": history_json(session.history),
        "status": {k: st.value for k, st in cmp.status.items()},
        "diff_stats": stats,
        "files": {"reference": "reference.dump", "subject": "subject.dump", "screenshot": SCREENSHOT},
    }
    _write_json(folder / REPORT, report)
    return folder


def write_diff(folder: Path, path_a: str, path_b: str, a: Mapping[str, int], b: Mapping[str, int],
               cmp: Comparison) -> Path:
    """Diff mode: copies of both dumps (as read) and a report; there are no raw buffers for statistics."""
    write_dump(folder / "a.dump", a.items())
    write_dump(folder / "b.dump", b.items())
    report = {
        "kestrel_tui": _version(),
        "created": datetime.now().isoformat(timespec="seconds"),
        "model": None,
        "a": str(path_a),
        "b": str(path_b),
        "first_diff": cmp.first_diff,
        "first_mismatch": cmp.first_mismatch,
        "identical": cmp.identical,
        "counts": _counts(cmp),
        "status": {k: st.value for k, st in cmp.status.items()},
        "diff_stats": None,  # dump files carry hashes only
        "files": {"a": "a.dump", "b": "b.dump", "screenshot": SCREENSHOT},
    }
    _write_json(folder / REPORT, report)
    return folder
