"""The repository speaks of the product (docs/architecture.md, "results/ and scripts/").

Read from the tracked files (`git ls-files`; skipped outside a git checkout):

(a) every `results/...` or `scripts/...` path that README.md, docs/, results/, scripts/, tests/,
    kestrel_tui/ or kernels/ mention exists — except a path read from git history
    (`git show <commit>:results/...`) and a placeholder (`...`, `NAME`, `<x>`, `*`);
(b) no tracked text file names a path of a development machine (a checkout under /work, /root,
    a home folder, an interpreter's site-packages);
(c) README.md, docs/, results/, scripts/, kestrel_tui/ and kernels/ speak of no work session or
    issue number of this project ("session 8", "issue 17", "#12"); upstream projects' issues
    ("vLLM #2008", "llama.cpp PR 1234") are facts about those projects and allowed;
(d) every results/ page carries a command, a date, a machine and a commit;
(e) every `git show <commit>:<path>` they cite names a file or folder of that commit, and every
    `git show <tree>:<path>` or `git show <object>` names an object of the clone (where the clone
    has the commit or the tree; not checked in a shallow clone);
(f) README.md, docs/, results/, scripts/, tests/, kestrel_tui/ and kernels/ speak the words of the
    product, not of the workplace it was built in: no `$OUT` (a runner's output folder), no GPU
    machines lent or loaned, no issue numbers glued to a name (`gpu_issue6.py`, `h200-issue20`), no
    run folders named by date and work period (`2026-11-30-s7`), no device calls or sessions, no
    machine time left or spent, no helper reviews or subagents, no folders beside the checkout.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = (".md", ".py", ".cu", ".cuh", ".toml", ".txt", ".sh", ".cfg", ".yml", ".yaml", ".c", ".h")
CITING = ("README.md", "docs/", "results/", "scripts/", "tests/", "kestrel_tui/", "kernels/")
PRODUCT = ("README.md", "docs/", "results/", "scripts/", "kestrel_tui/", "kernels/")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]


def _text(paths, prefixes) -> dict[str, str]:
    return {p: (ROOT / p).read_text(errors="replace") for p in paths
            if p.startswith(prefixes) and p.endswith(TEXT)}


def _where(path: str, text: str, start: int) -> str:
    return f"{path}:{text.count(chr(10), 0, start) + 1}"


# a path starts after a space, quote, bracket or line start; it is not part of a longer path
CITED = re.compile(r"(?<![\w./:<>-])((?:results|scripts)/[\w./*<>-]*)")
PLACEHOLDER = re.compile(r"\.\.\.|…|NAME|<|>|\*")


def test_cited_results_and_scripts_exist():
    files = _tracked()
    missing = []
    for path, text in _text(files, CITING).items():
        for m in CITED.finditer(text):
            cited = m.group(1).rstrip(".-")
            if PLACEHOLDER.search(cited):
                continue
            if not (ROOT / cited).exists():
                missing.append(f"{_where(path, text, m.start())}: {cited}")
    assert not missing, "cited files that do not exist (cite `git show <commit>:PATH` instead):\n" + "\n".join(missing)


DEV_PATH = re.compile("|".join([
    r"/" + "work/",                      # a development checkout or its shared folders
    r"/" + r"root/",
    r"site" + r"-packages",
    r"/" + r"home/(?!me/)\w+",            # docs/profiles.md's /home/me is an example user's
    r"/" + r"Users/\w+",
]))


def test_no_development_machine_paths():
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    found = [f"{_where(p, t, m.start())}: {m.group(0)}"
             for p, t in _text(_tracked(), ("",)).items() if p != me
             for m in DEV_PATH.finditer(t)]
    assert not found, "paths of a development machine (use a relative path or a package name):\n" + "\n".join(found)


WORK_WORDS = re.compile(r"\b(?:[Ss]ession|[Ii]ssue)s?[ -]#?\d+|(?<![\w&#/])#\d+\b")
UPSTREAM = re.compile(r"(?:llama\.cpp|ggml|vLLM|vllm|transformers|torch|PyTorch|pytorch|CUDA|Textual|"
                      r"numpy|hypothesis|PyCUDA|upstream)[^\n]{0,24}$")


def test_no_session_or_issue_words():
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    found = []
    for path, text in _text(_tracked(), PRODUCT).items():
        if path == me:
            continue
        for m in WORK_WORDS.finditer(text):
            if m.group(0).startswith("#") and not path.endswith(".md"):
                continue  # format specs and colours in code ({x:#04x}, "#121212")
            if UPSTREAM.search(text[max(0, m.start() - 40):m.start()]):
                continue
            found.append(f"{_where(path, text, m.start())}: {m.group(0)}")
    assert not found, ("work sessions or issue numbers (state a commit, a date, a figure):\n"
                       + "\n".join(found))


COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"\bVM\b|H200|\bhost\b|\bcores?\b")
COMMAND = re.compile(r"`[^`]*\b(?:python3?|kestrel-tui|pytest)\b|^ {4}.*\b(?:python3?|kestrel-tui)\b", re.M)


def test_results_pages_carry_command_date_machine_commit():
    pages = [p for p in _tracked() if p.startswith("results/") and p.endswith(".md")]
    lacking = []
    for p in pages:
        text = (ROOT / p).read_text()
        gaps = [name for name, rx in (("command", COMMAND), ("date", DATE), ("machine", MACHINE),
                                      ("commit", COMMIT)) if not rx.search(text)]
        if gaps:
            lacking.append(f"{p}: no {', '.join(gaps)}")
    assert not lacking, "results pages must say how, when, where and on what they measured:\n" + "\n".join(lacking)


GIT_SHOW = re.compile(r"git show ([0-9a-f]{7,40}\^?):([\w./*-]+)")


def test_cited_history_exists():
    refs: dict[str, str] = {}
    for path, text in _text(_tracked(), CITING).items():
        for m in GIT_SHOW.finditer(text):
            ref = f"{m.group(1)}:{m.group(2).rstrip('.-')}"
            if not PLACEHOLDER.search(ref):
                refs.setdefault(ref, _where(path, text, m.start()))
    # a shallow clone may lack a commit: only the refs of commits (or trees) it has are checked
    revs = {r.split(":")[0] for r in refs}
    known = {r for r in revs if subprocess.run(["git", "cat-file", "-e", f"{r}^{{tree}}"], cwd=ROOT,
                                               capture_output=True).returncode == 0}
    asked = [r for r in refs if r.split(":")[0] in known]
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True,
                         input="".join(f"{r}\n" for r in asked), check=True).stdout.splitlines()
    missing = [f"{refs[r]}: git show {r}" for r, line in zip(asked, out) if line.endswith(" missing")]
    assert not missing, "cited history that the commit does not hold:\n" + "\n".join(missing)


GIT_OBJECT = re.compile(r"git show ([0-9a-f]{7,40})(?![\w:^~.])")


def test_cited_objects_exist():
    """A file or folder of history cited by its object id (`git show 9f49f001df`) is in the clone."""
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone (or no git): history objects may be absent")
    refs: dict[str, str] = {}
    for path, text in _text(_tracked(), CITING).items():
        for m in GIT_OBJECT.finditer(text):
            refs.setdefault(m.group(1), _where(path, text, m.start()))
    missing = [f"{where}: git show {ref}" for ref, where in refs.items()
               if subprocess.run(["git", "cat-file", "-e", ref], cwd=ROOT, capture_output=True).returncode != 0]
    assert not missing, "cited objects that the clone does not hold:\n" + "\n".join(missing)


# Words of the workplace the code was written in, each with what the product says instead. Each is
# precise enough to leave the product's own words alone: a Session, a process session (setsid),
# "device time" of a kernel, a raw store's budget.
WORKPLACE = [
    (r"\$\{?OUT\b", "a runner's output folder: write `--out result.json` or name the folder"),
    (r"(?i)\b(?:lent|lend|lending|loans?|loaned)\b", "a GPU on loan: name the machine (an NVIDIA H200 host)"),
    (r"(?i)issue[_-]?#?\d+", "an issue number in a name: name the thing by what it does"),
    (r"(?:\b20\d\d-\d\d-\d\d|…)-s\d+\b", "a run folder named by a work period: cite a commit, a date, a tree id"),
    (r"(?i)\bdevice\s+(?:calls?|sessions?)\b", "a call of a lending tool: say a run on the machine"),
    (r"(?i)\b\d+\s+s\s+of\s+(?:\d+\s+s\s+of\s+)?device\s+time\b|\bdevice\s+time\s+(?:was\s+)?(?:left|spent)\b"
     r"|\bno\s+device\s+time\b", "machine time of a loan (device time is a kernel's): say machine time"),
    (r"(?i)\b(?:machine|one-GPU)\s+kind\b", "a lending tool's kind: say the machine type"),
    (r"(?i)\bcarr(?:y|ying|ied)\s+\.\w", "a lending tool's carry: say which folders are in the tree"),
    (r"(?i)\bsub-?agents?\b|\bhelper\s+(?:reviews?|sessions?)\b|\bother\s+engineers\b",
     "the people and agents who wrote it: say what was done"),
    (r"\.\./shared/", "a folder beside the checkout: say what it holds"),
]


def test_no_workplace_words():
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    found = []
    for path, text in _text(_tracked(), PRODUCT + ("tests/",)).items():
        if path == me:
            continue
        for rx, instead in WORKPLACE:
            for m in re.finditer(rx, text):
                found.append(f"{_where(path, text, m.start())}: {m.group(0)!r} ({instead})")
    assert not found, "words of the workplace, not of the product:\n" + "\n".join(found)
