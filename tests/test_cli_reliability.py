"""What a fuzzer and a new user broke in the headless commands: markup in
names, absurd indices, interrupted dumps, messages that blame the wrong thing, cut keys."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel_tui.cli import main

from clitools import one_line_error, run_cli as run

MARKUP_TAGS = ["a[/b]", "t0_l0_[/x]", "[red]x", "[bold]t1_emb[/bold]"]


def write(path: Path, items) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} {h:016x}\n" for k, h in items))
    return path


@pytest.mark.parametrize("where", ["both", "a", "b"])
def test_diff_prints_markup_tags_as_written(tmp_path, capsys, where):
    base = [("t0_emb", 1)]
    tagged = base + [(t, 7 + i) for i, t in enumerate(MARKUP_TAGS)]
    a = write(tmp_path / "a.txt", tagged if where in ("both", "a") else base)
    b = tagged if where in ("both", "b") else base
    if where == "both":
        b = b[:-1] + [(MARKUP_TAGS[-1], 99)]  # one DIFF, on a markup tag
    b = write(tmp_path / "b.txt", b)
    code, out, err = run(capsys, "diff", a, b)
    assert code == 1 and err == ""
    if where == "both":
        assert f"first DIFF: {MARKUP_TAGS[-1]}  " in out
    else:
        assert "first missing: " in out
        missing = out.split("first missing: ")[1].split(" (")[0]
        assert missing in MARKUP_TAGS  # printed literally, brackets and all


def test_identical_markup_tags_exit_0(tmp_path, capsys):
    a = write(tmp_path / "a.txt", [(t, 5) for t in MARKUP_TAGS])
    code, out, _ = run(capsys, "diff", a, a)
    assert code == 0 and out.strip() == f"identical: {len(MARKUP_TAGS)} keys"


def test_markup_paths_for_diff_and_dump(tmp_path, capsys):
    folder = tmp_path / "[/x]" / "[red]y"
    a = write(folder / "a[/b].txt", [("t0_emb", 1)])
    b = write(folder / "b.txt", [("t0_emb", 2)])
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1 and f"{a} vs {b}" in out
    code, _, err = run(capsys, "diff", a, folder / "[/nope].txt")
    assert code == 2 and f"{folder}/[/nope].txt: cannot read" in one_line_error(err)
    out_path = folder / "new[red].txt"
    code, out, err = run(capsys, "dump", "--tokens", "1", "--out", out_path)
    assert code == 0 and err == "" and out.startswith(f"wrote {out_path}: 17 positions")
    assert len(out_path.read_text().splitlines()) == 17 * 530


def test_absurd_index_is_one_line_exit_2_with_and_without_tui(tmp_path, capsys):
    good = write(tmp_path / "good.txt", [("t0_emb", 1)])
    bad = write(tmp_path / "bad.txt", [("t0_emb", 1), ("t" + "1" * 30 + "_emb", 2)])
    for extra in ([], ["--tui"]):
        code, _, err = run(capsys, "diff", good, bad, *extra)
        line = one_line_error(err)
        assert code == 2 and f"{bad}:2:" in line and "position index 111111111111... (30 digits)" in line


def test_huge_position_diff_tui_under_tmux(tmp_path):
    """The app itself over t1000000000: opens (board sized by positions present), q quits, exit 1."""
    if not _have("tmux"):
        pytest.skip("tmux is not installed")
    a = write(tmp_path / "a.txt", [("t0_emb", 1), ("t1000000000_emb", 2), ("t1000000000_logits", 3)])
    b = write(tmp_path / "b.txt", [("t0_emb", 1), ("t1000000000_emb", 9), ("t1000000000_logits", 3)])
    name = f"kestrel-test-{os.getpid()}"
    cmd = f"{sys.executable} -m kestrel_tui.cli diff {a} {b} --tui; echo EXIT=$? > {tmp_path}/rc"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "120", "-y", "40", cmd], check=True)
    try:
        screen = ""
        for _ in range(100):
            time.sleep(0.2)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True,
                                    text=True).stdout
            if "t1000000000" in screen:
                break
        assert "t1000000000" in screen, screen
        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
        for _ in range(50):
            if (tmp_path / "rc").exists():
                break
            time.sleep(0.2)
        assert (tmp_path / "rc").read_text().strip() == "EXIT=0"  # q quits the app: 0, as from the app
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def _have(tool: str) -> bool:
    from shutil import which

    return which(tool) is not None


def test_sigint_half_way_through_dump_leaves_nothing_at_out(tmp_path):
    out = tmp_path / "ref.txt"
    # 416 positions: SIGINT once the first 100 kB are written lands in the middle. The child gets
    # SIGINT's default action whatever this process inherited: a shell without job control starts
    # its background commands (pytest run with `&` from a script) with SIGINT ignored, and an
    # ignored SIGINT stays ignored through exec — the dump would then finish, rc 0.
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_tui.cli", "dump", "--tokens", "400", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until lines are being written
        tmp = [p for p in tmp_path.iterdir() if p.name.startswith(".ref.txt.")]
        if tmp and tmp[0].stat().st_size > 100_000:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the dump ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert not out.exists()
    partial = tmp_path / "ref.txt.partial"
    assert err.strip() == f"interrupted; the unfinished output is kept as {partial} (not a whole file)"
    assert [p.name for p in tmp_path.iterdir()] == ["ref.txt.partial"]  # no hidden leftovers
    n_lines = len(partial.read_text().splitlines())
    assert 0 < n_lines < 416 * 530
    rc = subprocess.run([sys.executable, "-m", "kestrel_tui.cli", "diff", str(partial), str(partial)],
                        capture_output=True, text=True)
    assert rc.returncode == 2 and "partial dump" in one_line_error(rc.stderr)
    # the same --out again works: nothing is at --out, and the partial one is left alone
    rc = subprocess.run([sys.executable, "-m", "kestrel_tui.cli", "dump", "--tokens", "1", "--out", str(out)],
                        capture_output=True, text=True)
    assert rc.returncode == 0 and out.exists() and len(partial.read_text().splitlines()) == n_lines


def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    out = tmp_path / "ref.txt"
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_tui.cli", "dump", "--tokens", "400", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(p.name.startswith(".ref.txt.") for p in tmp_path.iterdir()):
        time.sleep(0.05)
    proc.terminate()
    proc.communicate(timeout=60)
    assert proc.returncode == 130 and not out.exists() and (tmp_path / "ref.txt.partial").exists()


def test_iso_blames_m_not_tokens(capsys):
    code, _, err = run(capsys, "iso", "--m", "5000")
    line = one_line_error(err)
    assert code == 2 and line.startswith("kestrel-tui iso: error: --m 5000:") and "--tokens" not in line
    assert "use --m 4080 or less" in line


def test_bench_rejects_an_unknown_what(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--what", "bogus"])
    _, err = capsys.readouterr()
    assert e.value.code == 2 and "invalid choice: 'bogus'" in err


def test_bench_cuda_without_gpu_does_not_suggest_a_subject_bench_rejects(capsys, monkeypatch):
    from kestrel_tui.backends.cuda import runtime as rt

    def no_gpu():
        raise rt.CudaUnavailable("no CUDA device found")
    monkeypatch.setattr(rt, "runtime", no_gpu)
    code, out, err = run(capsys, "bench", "--subject", "cuda")
    line = one_line_error(err)
    assert code == 2 and "--subject sim" not in line and "no CUDA device found" in line
    assert "plain `kestrel-tui bench` gives the CPU figures" in line


def test_piped_iso_keeps_keys_and_ulp_whole(tmp_path):
    """Through a pipe (80 columns), every key and number in the table is whole on one line."""
    env = {**os.environ, "COLUMNS": "80"}
    argv = [sys.executable, "-m", "kestrel_tui.cli", "iso", "--m", "3", "--tokens", "3", "--prompt-ids",
            ",".join(str(7 * i + 1) for i in range(16))]
    table = subprocess.run(argv, capture_output=True, text=True, env=env)
    cols = json.loads(subprocess.run(argv + ["--json"], capture_output=True, text=True, env=env).stdout)
    assert table.returncode == 1 and all(len(l) <= 80 for l in table.stdout.splitlines())
    # a row's first line; the top1 column may fold onto more lines, keys and figures never do
    rows = [l for l in table.stdout.splitlines() if l.startswith("│") and l[1:].split("│")[0].strip()]
    assert len(rows) == 3
    for c, row in zip(cols, rows):
        cells = [x.strip() for x in row.strip("│").split("│")]
        assert cells[:7] == [str(c["j"]), str(c["t"]), str(c["token"]), str(c["ndiff"]), "-" if c["first_index"] is None else str(c["first_index"]),
                             str(c["max_ulp"]), c["first_diff_key"] or "-"]
