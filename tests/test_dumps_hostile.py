"""Hostile one-pass dump folders (`TP0_PP0_Rank0_pid1/Pass00000.pt`, a few KB) through the CLI in-process:
`diff A B`, `diff A B --tol`, and `run` with the vllm-dump engine each answer exit 2 with one stderr line
naming the file and the field, quickly and without a traceback. Exit 1 means DIFF, so a crash must never
give it."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from clitools import run_cli  # noqa: E402

IDS, POSITIONS = "model.forward_batch_info.input_ids", "model.forward_batch_info.positions"
EMB = "model.embed_tokens"
PROMPT = [5, 77, 19, 33]
SECONDS = 5  # the reader's refusal: diff reads only the folders
RUN_SECONDS = 20  # run decodes the reference first (a few seconds on a cold cache, on a loaded 2-core machine)


def write_pass(folder: Path, entries: dict, n: int = 0) -> Path:
    """One pass file of rank 0 under ``folder``: a valid forward of PROMPT with ``entries`` over it."""
    d = {IDS: torch.tensor(PROMPT), POSITIONS: torch.arange(len(PROMPT)), EMB: torch.ones(len(PROMPT), 8)}
    d.update(entries)
    path = folder / "TP0_PP0_Rank0_pid1" / f"Pass{n:05d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(d, path)
    return path


def _profile(tmp_path: Path, folder: Path) -> Path:
    p = tmp_path / "dump.toml"
    p.write_text(f'[reference]\nengine = "cpu"\n[subject]\nengine = "vllm-dump"\n'
                 f'[subject.options]\nfolder = "{folder}"\n')
    return p


def _commands(tmp_path: Path, bad: Path, good: Path, first: bool) -> list[tuple]:
    plain = ("diff", bad, good) if first else ("diff", good, bad)
    return [plain, ("diff", bad, good, "--tol", "nmse=1e-7"),
            ("run", "--profile", _profile(tmp_path, bad), "--prompt-ids", ",".join(map(str, PROMPT)),
             "--tokens", "1", "--kv", "f32", "--weights", "f32")]


def refused_everywhere(capsys, tmp_path: Path, entries: dict, *needles: str, first: bool = False) -> None:
    """``first``: the bad folder on the left of the plain diff too. On the right, and in `run`, its request
    is looked up by the session's tokens, and one that cannot hold them is refused for that in one line
    naming the folder and the request's positions (asserted as such)."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    write_pass(good, {})
    path = write_pass(bad, entries)
    for argv in _commands(tmp_path, bad, good, first):
        t0 = time.monotonic()
        code, _, err = run_cli(capsys, *argv)
        took = time.monotonic() - t0
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (argv[0], code, err[-2000:])
        if first and argv[0] == "run":
            assert "no dumped request has the session's tokens" in lines[0] and str(2**30) in lines[0], lines[0]
        else:
            assert str(path) in lines[0] and all(n in lines[0] for n in needles), lines[0]
        assert took < (RUN_SECONDS if argv[0] == "run" else SECONDS), (argv[0], took)


def test_a_huge_position(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {POSITIONS: torch.arange(4) + 2**40}, POSITIONS)


def test_a_position_a_request_starts_far_into(capsys, tmp_path):
    """Within the keys' range, but 2^30 empty positions before it: bounded before the loop builds them."""
    refused_everywhere(capsys, tmp_path, {POSITIONS: torch.arange(4) + 2**30}, POSITIONS, first=True)


def test_negative_positions(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {POSITIONS: torch.arange(4) - 1000}, POSITIONS)


def test_ids_expanded_to_2_31_rows(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {IDS: torch.zeros(1, dtype=torch.int64).expand(2**31)}, IDS, "overlap")


def test_int32_ids_expanded_to_2_40_rows(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {IDS: torch.zeros(1, dtype=torch.int32).expand(2**40)}, IDS)


def test_an_activation_expanded_with_stride_0(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {EMB: torch.zeros(1, 1).expand(4, 2**34)}, EMB, "overlap")


def test_a_sparse_activation(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {EMB: torch.ones(4, 8).to_sparse()}, EMB, "sparse")


def test_a_meta_tensor(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {EMB: torch.empty(4, 8, device="meta")}, EMB, "meta")


def test_an_int32_activation(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {EMB: torch.ones(4, 8, dtype=torch.int32)}, EMB, "int32")


def test_float_ids(capsys, tmp_path):
    refused_everywhere(capsys, tmp_path, {IDS: torch.tensor([5.0, 77.0, 19.0, 33.0])}, IDS)


# ---- many pass files: the token index keeps no file's mapping


def test_the_token_index_keeps_no_mapping(tmp_path):
    """Every pass file's mapping is closed once the index is built (each one kept alive ran past the system's
    limit on mappings near 65,000 files): no indexed array views a mapped storage, and nothing of the
    files' tensors is left once they are dropped."""
    import gc
    import weakref

    from kestrel_tui.engines.dumps.passes import PassFolders

    for n in range(3):
        write_pass(tmp_path, {POSITIONS: torch.arange(4) + 4 * n}, n)
    folder = PassFolders(tmp_path, "vLLM")
    seen = []
    real = torch.load

    def spy(*a, **kw):
        obj = real(*a, **kw)
        seen.extend(weakref.ref(v.untyped_storage()) for v in obj.values() if isinstance(v, torch.Tensor))
        return obj

    torch.load = spy
    try:
        steps = folder.index()
    finally:
        torch.load = real
    gc.collect()
    assert len(steps) == 3 and [int(p[0]) for _, p in steps] == [0, 4, 8]
    assert all(ids.base is None and pos.base is None for ids, pos in steps)
    assert seen and all(r() is None for r in seen)


def test_a_dump_of_another_models_width_is_compared_not_crashed(capsys, tmp_path):
    """A readable dump whose `emb` is 8 wide against the embedded model's 256: the hashes differ (a DIFF,
    exit 1) and nothing element by element is claimed; before, the first DIFF's statistics raised."""
    good = tmp_path / "good"
    write_pass(good, {})
    code, out, err = run_cli(capsys, *_commands(tmp_path, good, good, True)[2])
    assert code == 1 and "Traceback" not in err, err[-2000:]
    assert "t0_emb" in out


def test_a_noted_folder_then_a_refusal_is_one_line(capsys, tmp_path):
    """A folder read with a note (a request starting past position 0: a cached prefix) against one that
    cannot hold its tokens: the refusal is the one line; the note is said only when both sides are read."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    write_pass(good, {})
    write_pass(bad, {POSITIONS: torch.arange(4) + 1000})
    code, _, err = run_cli(capsys, "diff", bad, good)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "no dumped request has the session's tokens" in lines[0], err
    code, out, err = run_cli(capsys, "diff", bad, bad)  # read whole: the note, then the verdict
    assert code == 0 and "identical" in out and err.startswith("note: ") and "position 1000" in err, err
