"""The process engine: any OS command that appends ``<tag> <hash16>`` lines to a file it is told about.

The seed's engine is a C program switched by env vars that appends one dump
line per buffer to the file named by ``VLLM_L2_DUMP``. This engine starts such
a command once per run with a fresh dump file in a private temporary folder,
reads the file as it grows (complete lines only) and hands each position to
``on_position`` as soon as a key of a later position appears, so the app's
grid fills while the engine runs. Optional raw values come from an
append-only sidecar file (engines/sidecar.py) read the same way.

A position is complete when a key of a later position appears, or when the
process exits 0, or — when it fails — if every key of the fields the profile
declares has arrived; the prompt's positions complete together (an engine
may write its prefill layer by layer across positions), decode positions one
by one.
docs/engines-process.md is the user's guide: options, placeholders, toggles,
failures, the sidecar format with C and Python writers.
"""
from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import procs
from ..bounds import SECONDS
from ..errors import UsageError
from ..text import inert, inert_tail
from ..trace.dump import DumpError, DumpTail
from ..trace.keys import emb_key, key_name, logits_key, parse_key
from ..trace.rawstore import RawStore
from .base import Capabilities, Engine, EngineFailed, EngineSpec, RunRequest, Toggle
from .sidecar import SidecarError, SidecarReader

OPTIONS = {
    "command": "the program and its arguments: a list of strings, or one string split like a shell does",
    "dump_env": "the env var that names the dump file (VLLM_L2_DUMP); or put {dump} in the command",
    "raw_env": "the env var that names the raw-values sidecar; or put {raw} in the command",
    "env": "a table of fixed env vars (a value of \"\" unsets the variable)",
    "cwd": "the folder the command runs in",
    "timeout": "seconds the whole run may take (default: no limit)",
    "idle_timeout": "seconds without a new dump line or sidecar record before the run counts as hung"
                    " (default: no limit)",
    "fields": "the probe fields the engine writes (emb, nrm, ..., logits); a key of another field reads"
              " missing-by-design instead of failed (default: any)",
    "name": "the engine's name in headers (default: the program's file name)",
}
PLACEHOLDERS = ("dump", "raw", "prompt_ids", "n_prompt", "n_tokens", "forced_ids", "model")
POLL_S = 0.02        # how often the files are read: fast enough for a live grid, cheap on 2 cores
_PH_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN_RE = re.compile(r"t(0|[1-9][0-9]*)_token")  # a sidecar record of the consumed token id
_INTERPRETERS = re.compile(r"(python[0-9.]*|pypy[0-9.]*|bash|sh|node|perl|ruby|env)(\.exe)?")
# Called with one line before a profile's command first runs (the CLI prints it on stderr; the app,
# whose terminal is the grid, leaves it unset). None: say nothing.
announce = None
_announced: set[tuple] = set()


def reset_announced() -> None:
    _announced.clear()


def _bad(msg: str) -> UsageError:
    return UsageError(f"process engine: {msg}")


def _tag(tag: str) -> str:
    """A tag from the engine's files, for a message: quoted, and clipped (a tag may be kilobytes)."""
    return inert(repr(tag), 120)


def _clip(s: str, n: int = 200) -> str:
    return s if len(s) <= n else s[:n - 3] + "..."


# ---------------------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class ProcessConfig:
    command: tuple[str, ...]
    dump_env: str | None = None
    raw_env: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    timeout: float | None = None
    idle_timeout: float | None = None
    fields: frozenset[str] | None = None
    name: str = "process"
    model: str | None = None  # the profile's model path, for {model}

    def uses(self, placeholder: str) -> bool:
        texts = (*self.command, *(v for _, v in self.env))
        return any(f"{{{placeholder}}}" in s for s in texts)

    @property
    def sidecar(self) -> bool:
        return self.raw_env is not None or self.uses("raw")


def _env_name(opt: str, v: object) -> str:
    if not isinstance(v, str) or not _ENV_RE.fullmatch(v):
        raise _bad(f"`{opt}` {v!r}: expected an env var name like VLLM_L2_DUMP")
    return v


def _seconds(opt: str, v: object) -> float | None:
    """A timeout; left out, none (inf or nan would switch it off unseen: refused)."""
    if v is None:
        return None
    problem = "is a string" if isinstance(v, str) else SECONDS.problem(v)  # TOML numbers are unquoted
    if problem is not None:
        raise _bad(f"`{opt}` {v!r}: {problem}; want {SECONDS.allowed()}, or leave it out for no limit")
    return float(v)


def _command(v: object) -> tuple[str, ...]:
    if v is None:
        raise _bad("needs `command`: the program and its arguments (a list of strings or one string)")
    if isinstance(v, str):
        try:
            argv = shlex.split(v)
        except ValueError as e:
            raise _bad(f"`command` {_clip(v, 60)!r}: cannot split it ({e}); give a list of strings") from None
    elif isinstance(v, (list, tuple)) and all(isinstance(a, str) for a in v):
        argv = list(v)
    else:
        raise _bad(f"`command` {_clip(repr(v), 60)}: expected a list of strings or one string")
    if not argv or not argv[0]:
        raise _bad("`command` is empty; name the program to run")
    return tuple(argv)


def _env_table(v: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(v, Mapping):
        raise _bad(f"`env` {_clip(repr(v), 60)}: expected a table of NAME = \"value\"")
    out = []
    for k, val in v.items():
        _env_name("env", k)
        if isinstance(val, bool) or not isinstance(val, (str, int, float)):
            raise _bad(f"`env` {k} = {val!r}: expected a string (quote it: \"1\")")
        out.append((k, str(val)))
    return tuple(out)


def _default_name(argv: tuple[str, ...]) -> str:
    """The program's file name; for `python tool.py` the script's, which says more."""
    names = [os.path.basename(a) for a in argv]
    if _INTERPRETERS.fullmatch(names[0]) and len(names) > 1 and not argv[1].startswith("-"):
        return names[1]
    return names[0]


def parse_options(options: Mapping[str, object], model: str | None = None) -> ProcessConfig:
    """Validate a profile's [subject.options] table; raises a one-line UsageError."""
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        raise _bad(f"unknown option {unknown[0]!r}; the options are {', '.join(OPTIONS)}")
    argv = _command(options.get("command"))
    dump_env = options.get("dump_env")
    raw_env = options.get("raw_env")
    fields = options.get("fields")
    if fields is not None and (not isinstance(fields, (list, tuple)) or not all(isinstance(f, str) for f in fields)):
        raise _bad(f"`fields` {_clip(repr(fields), 60)}: expected a list of field names like [\"nrm\", \"x\"]")
    name = options.get("name", _default_name(argv))
    if not isinstance(name, str) or not name.strip():
        raise _bad(f"`name` {name!r}: expected a non-empty string")
    cwd = options.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise _bad(f"`cwd` {cwd!r}: expected a folder path")
    cfg = ProcessConfig(
        command=argv,
        dump_env=None if dump_env is None else _env_name("dump_env", dump_env),
        raw_env=None if raw_env is None else _env_name("raw_env", raw_env),
        env=_env_table(options.get("env", {})),
        cwd=cwd, timeout=_seconds("timeout", options.get("timeout")),
        idle_timeout=_seconds("idle_timeout", options.get("idle_timeout")),
        fields=None if fields is None else frozenset(fields), name=name, model=model)
    for s in (*cfg.command, *(v for _, v in cfg.env)):
        for ph in _PH_RE.findall(s):
            # other braces are the command's own (a script's f-string, awk's {print}); a near-miss is a typo
            near = difflib.get_close_matches(ph, PLACEHOLDERS, n=1, cutoff=0.75)
            if ph not in PLACEHOLDERS and near:
                raise _bad(f"unknown placeholder {{{ph}}} in {_clip(s, 60)!r}; did you mean {{{near[0]}}}?"
                           f" (the placeholders are {', '.join('{' + p + '}' for p in PLACEHOLDERS)})")
    if cfg.dump_env is None and not cfg.uses("dump"):
        raise _bad("set `dump_env` (the env var the engine reads, e.g. VLLM_L2_DUMP) or put {dump} in `command`"
                   " so the engine knows where to write its dump")
    if cfg.uses("model") and not model:
        raise _bad("`command` uses {model} but the profile names no model")
    _check_program(cfg)
    return cfg


def _check_program(cfg: ProcessConfig) -> None:
    """A missing program is a profile error now, before a command opens its output file (Popen checks again)."""
    prog = cfg.command[0]
    if _PH_RE.search(prog):
        return  # filled in per run
    if os.sep in prog:
        where = prog if os.path.isabs(prog) or cfg.cwd is None else os.path.join(cfg.cwd, prog)
        found = os.path.isfile(where)
    else:
        found = shutil.which(prog, path=dict(cfg.env).get("PATH") or os.environ.get("PATH")) is not None
    if not found:
        raise _bad(f"command {prog!r} not found; fix `command` in the profile")


def _check_toggles(toggles: tuple[Toggle, ...], cfg: ProcessConfig) -> tuple[Toggle, ...]:
    for t in toggles:
        k = t.key
        if not k:
            raise _bad(f"toggle {t.name!r} has no key; set key to the env var it sets (VLLM_CUDA_L2EXACT)"
                       f" or the flag it adds (--cuda)")
        if not (k.startswith("-") and " " not in k) and not _ENV_RE.fullmatch(k):
            raise _bad(f"toggle {t.name!r}: key {k!r} is neither an env var name nor a flag starting with -")
        if k in (cfg.dump_env, cfg.raw_env):
            raise _bad(f"toggle {t.name!r}: key {k} is the dump's own variable; pick another")
    return toggles


def make_process_engine(spec: EngineSpec, model=None, kv: str = "q8", deep: bool = False) -> "ProcessEngine":
    """kv and deep are the reference's; the command decides its own KV format and probe set."""
    cfg = parse_options(spec.options or {}, spec.model)
    return ProcessEngine(cfg, _check_toggles(tuple(spec.toggles or ()), cfg), model)


# ---------------------------------------------------------------------------------------------- invocation


def forced_ids(cfg: ProcessConfig, req: RunRequest) -> list[int] | None:
    """The tokens to force, or None: a free run. A reference that reported no tokens (-1) cannot
    be followed, so that run is free too."""
    if not cfg.uses("forced_ids") or req.forced is None or any(i < 0 for i in req.forced):
        return None
    return list(req.forced[:req.n_tokens])


def _fill(s: str, values: Mapping[str, str]) -> str:
    return _PH_RE.sub(lambda m: values.get(m[1], m[0]), s)


def invocation(cfg: ProcessConfig, toggles: tuple[Toggle, ...], req: RunRequest, dump: str,
               raw: str | None, base_env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of one run (placeholders filled, toggles applied)."""
    forced = forced_ids(cfg, req)
    values = {"dump": dump, "raw": raw or "", "prompt_ids": ",".join(map(str, req.prompt)),
              "n_prompt": str(len(req.prompt)), "n_tokens": str(req.n_tokens),
              "forced_ids": "" if forced is None else ",".join(map(str, forced)),
              "model": cfg.model or ""}
    argv: list[str] = []
    for a in cfg.command:
        if forced is None and "{forced_ids}" in a:
            # no forcing: the argument goes, and with it the flag that introduces a bare {forced_ids}
            if a == "{forced_ids}" and argv and argv[-1].startswith("-"):
                argv.pop()
            continue
        argv.append(_fill(a, values))
    env = dict(os.environ if base_env is None else base_env)

    def put(k: str, v: str):
        if v == "":
            env.pop(k, None)
        else:
            env[k] = v

    for k, v in cfg.env:
        put(k, "" if forced is None and "{forced_ids}" in v else _fill(v, values))
    if cfg.dump_env:
        env[cfg.dump_env] = dump
    if cfg.raw_env and raw:
        env[cfg.raw_env] = raw
    for t in toggles:
        v = req.values.get(t.name, t.default)
        if t.key.startswith("-"):
            if v not in ("on", "off", ""):
                argv += [t.key, v]
            elif v == "on":
                argv.append(t.key)
        else:
            put(t.key, v)
    return argv, env


# ---------------------------------------------------------------------------------------------- reading


class _ContentError(Exception):
    """The engine wrote something we cannot read (one line naming the file and line or offset)."""


class Assembler:
    """Dump keys and sidecar records -> Positions, each emitted once complete, in order."""

    def __init__(self, req: RunRequest, *, prompt_known: bool, forced: list[int] | None, vocab: int | None,
                 keep_raw: bool, store: RawStore, dump_label: str, raw_label: str,
                 fields: frozenset[str] | None = None, n_layers: int | None = None):
        self.req, self.P = req, len(req.prompt)
        self.last = self.P + req.n_tokens - 1
        self.prompt_known, self.forced, self.vocab, self.keep_raw = prompt_known, forced, vocab, keep_raw
        self.store, self.dump_label, self.raw_label = store, dump_label, raw_label
        self.hashes: dict[int, dict[str, int]] = {}
        self.raw: dict[int, dict[str, np.ndarray]] = {}
        self.logits: dict[int, np.ndarray] = {}
        self.tokens: dict[int, int] = {}
        self.first_line: dict[str, int] = {}
        self.hi = -1          # the latest position a dump key named
        self.next_t = 0       # the first position not yet emitted
        self.beyond: str | bool = False  # a key past the last asked-for position: everything asked for is in
        self.positions: list = []
        self._prev_top1 = -1
        self.raw_hi = -1      # the latest position a sidecar record named
        self.fields, self.n_layers = fields, n_layers

    def _declared(self, t: int) -> set[str] | None:
        """Every key the profile's `fields` say position t has (None: they are not declared)."""
        if not self.fields or self.n_layers is None:
            return None
        keys = {emb_key(t)} if "emb" in self.fields else set()
        if "logits" in self.fields:
            keys.add(logits_key(t))
        per_layer = self.fields - {"emb", "logits"}
        keys |= {key_name(t, li, f) for li in range(self.n_layers) for f in per_layer}
        return keys

    def complete_by_fields(self, upto: int) -> int:
        """``upto`` moved past every following position whose declared keys have all arrived: what an
        engine that then exits non-zero finished (without `fields` nothing tells a whole position)."""
        while upto <= min(self.hi, self.last):
            want = self._declared(upto)
            if not want or not want <= self.hashes.get(upto, {}).keys():
                break
            upto += 1
        return upto

    def _position(self, tag: str) -> int | None:
        try:
            return parse_key(tag).t
        except ValueError:
            return None

    def add_hash(self, n: int, tag: str, h: int) -> None:
        t = self._position(tag)
        if t is None:
            t = max(self.hi, 0)  # another engine's tag: it belongs to the position being written
        if t > self.last:
            self.beyond = self.beyond or tag  # the first such key, for the message when it is the first of all
            return
        if tag in self.first_line:
            raise _ContentError(f"{self.dump_label}:{n}: duplicate key {_tag(tag)}"
                                f" (first at line {self.first_line[tag]})")
        if t < self.ready():
            raise _ContentError(f"{self.dump_label}:{n}: key {_tag(tag)} arrives after position {t} was complete"
                                f" (a key of position {self.hi} came first); write positions in order")
        self.first_line[tag] = n
        self.hashes.setdefault(t, {})[tag] = h
        self.hi = max(self.hi, t)

    def add_raw(self, tag: str, a: np.ndarray, offset: int) -> None:
        m = _TOKEN_RE.fullmatch(tag)
        t = int(m[1]) if m else self._position(tag)
        if t is not None:
            self.raw_hi = max(self.raw_hi, t)
        where = f"{self.raw_label}: offset {offset}"
        if t is None:
            raise _ContentError(f"{where}: record tag {tag[:40]!r} is not a probe key (t<T>_emb, t<T>_l<L>_<field>,"
                                f" t<T>_logits or t<T>_token)")
        if t > self.last:
            return
        if t < self.next_t:
            raise _ContentError(f"{where}: record {_tag(tag)} arrives after position {t} was complete; write each"
                                f" record (and flush it) before the next key's dump line")
        if m:
            if a.size != 1 or a.dtype.kind not in "iu":
                raise _ContentError(f"{where}: record {_tag(tag)} must be one integer (i32 1)")
            self.tokens[t] = int(a.reshape(-1)[0])
            return
        if tag == logits_key(t):
            flat = a.astype(np.float32).reshape(-1)
            if self.vocab is not None and flat.size != self.vocab:
                raise _ContentError(f"{where}: record {_tag(tag)} has {flat.size} values; the model's vocabulary is"
                                    f" {self.vocab}")
            self.logits[t] = flat
        if self.keep_raw:
            raw = self.raw.setdefault(t, {})
            if tag in raw:
                raise _ContentError(f"{where}: duplicate record {_tag(tag)}")
            raw[tag] = a

    def ready(self, exited: bool = False, raw_behind: int | None = None) -> int:
        """Positions below this one are complete. ``raw_behind``: the sidecar reader has not caught up and
        its last record is of this position, so only the positions before it have all their records."""
        if self.beyond:
            upto = self.last + 1
        elif exited:
            upto = min(self.hi, self.last) + 1
        elif self.hi >= self.P:
            upto = self.hi  # the prompt's positions complete together, then one at a time
        else:
            upto = 0
        if raw_behind is not None:
            upto = min(upto, raw_behind if raw_behind >= self.P else 0)
        return upto

    def _token(self, t: int) -> int:
        if t in self.tokens:
            return self.tokens[t]
        if t < self.P:
            return self.req.prompt[t] if self.prompt_known else -1
        if self.forced is not None:
            return self.forced[t - self.P] if t - self.P < len(self.forced) else -1
        return self._prev_top1  # a free-running engine is taken to be greedy

    def emit(self, upto: int) -> Iterator:
        from ..trace.run import Position

        while self.next_t < upto:
            t = self.next_t
            raw = self.raw.pop(t, None)
            pos = Position(t=t, token=self._token(t), prompt=t < self.P, hashes=self.hashes.pop(t, {}),
                           raw=self.store.keep(raw) if raw else None, logits=self.logits.pop(t, None))
            self.tokens.pop(t, None)
            self._prev_top1 = pos.top1
            self.positions.append(pos)
            self.next_t += 1
            yield pos


# ---------------------------------------------------------------------------------------------- the child


def _output_tail(folder: Path) -> str:
    """The last non-blank line of stderr (else stdout), for a one-line failure message."""
    for name in ("stderr", "stdout"):
        try:
            with open(folder / f"{name}.txt", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if lines:
            return f"{name}: {inert_tail(lines[-1])}"
    return "no output on stderr"


def _exit_text(rc: int) -> str:
    if rc < 0:
        name = procs.signal_name(-rc)
        return f"was killed by signal {name}" if name.isidentifier() else f"was killed by {name}"
    return f"exited with code {rc}"


def _s(x: float) -> str:
    return f"{x:g}"


class ProcessEngine(Engine):
    def __init__(self, cfg: ProcessConfig, toggles: tuple[Toggle, ...] = (), model=None):
        self.cfg, self.toggles, self.name = cfg, toggles, cfg.name
        self.vocab = model.cfg.vocab if model is not None else None
        self.n_layers = model.cfg.n_layers if model is not None else None
        self.fields = cfg.fields
        self.caps = Capabilities(prefill_from=False, forcing=cfg.uses("forced_ids"), isolate=False,
                                 logits=cfg.sidecar, raw=cfg.sidecar, formats=False)

    @property
    def device_name(self) -> str:
        return f"process: {shlex.join(self.cfg.command)[:60]}"

    def prefill_problem(self, reference: Engine) -> str | None:
        return f"{self.name} runs its own prefill (a process cannot take another engine's KV rows)"

    def run(self, req: RunRequest):
        from ..trace.run import Cancelled

        if req.cancel is not None and req.cancel.is_set():
            raise Cancelled()
        folder = Path(procs.make_folder("kestrel-proc-"))
        keep_folder, proc = False, None
        try:
            dump = folder / "dump.txt"
            raw = folder / "raw.bin" if self.cfg.sidecar else None
            for p in (dump, raw):
                if p is not None:
                    os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # fresh, never a user's file
            argv, env = invocation(self.cfg, self.toggles, req, str(dump), str(raw) if raw else None)
            proc = self._start(argv, env, folder)
            return self._follow(proc, req, folder, dump, raw)
        except EngineFailed as e:
            keep_folder = getattr(e, "keep_folder", False)
            raise
        finally:
            if proc is not None:
                procs.kill_group(proc)
            if keep_folder:
                procs.keep_folder(folder, "kept as evidence: a failure message names a file here")
            else:
                procs.remove_folder(folder)

    def _start(self, argv: list[str], env: dict[str, str], folder: Path) -> subprocess.Popen:
        cwd = self.cfg.cwd
        if cwd is not None and not os.path.isdir(cwd):
            raise _bad(f"`cwd` {cwd!r}: no such folder; fix `cwd` in the profile")
        self._announce(cwd)
        # output goes to files, not pipes: nothing has to drain them, and the tail names the failure
        with open(folder / "stdout.txt", "wb") as out, open(folder / "stderr.txt", "wb") as err:
            try:
                # its own session: the tool's signals miss it, so the tool ends it (procs registers it)
                return procs.popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                   start_new_session=True)
            except FileNotFoundError:
                raise _bad(f"command {argv[0]!r} not found; fix `command` in the profile") from None
            except PermissionError:
                raise _bad(f"command {argv[0]!r} is not executable (permission denied); fix `command`"
                           f" in the profile") from None
            except OSError as e:
                raise _bad(f"cannot start {argv[0]!r}: {e.strerror or e}; fix `command` in the profile") from None

    def _announce(self, cwd: str | None) -> None:
        """Say which command the profile runs (as written: placeholders unfilled), once per command."""
        if announce is None:
            return
        key = (self.cfg.command, self.cfg.env, cwd)
        if key in _announced:
            return
        _announced.add(key)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.cfg.env)
        line = " ".join(x for x in (env, shlex.join(self.cfg.command)) if x)
        where = f" (in {cwd})" if cwd else ""
        announce(f"process engine {inert(self.name)}: running {inert(line, 1000)}{inert(where)}")

    def _follow(self, proc: subprocess.Popen, req: RunRequest, folder: Path, dump: Path, raw: Path | None):
        from ..trace.run import Cancelled, Trace

        forced = forced_ids(self.cfg, req)
        store = RawStore()
        asm = Assembler(req, prompt_known=self.cfg.uses("prompt_ids"), forced=forced, vocab=self.vocab,
                        keep_raw=req.raw, store=store, dump_label=str(dump), raw_label=str(raw),
                        fields=self.cfg.fields, n_layers=self.n_layers)
        trace = Trace(backend=self.describe(req.values), prompt=list(req.prompt), positions=asm.positions,
                      store=store)
        tail = DumpTail(str(dump))
        side = SidecarReader(raw) if raw is not None else None
        start = last_new = time.monotonic()

        def fail(why: str) -> EngineFailed:
            procs.kill_group(proc)
            n = len(asm.positions)
            return EngineFailed(f"process engine {inert(self.name)}: {why} after {n} position{'s' * (n != 1)};"
                                f" {_output_tail(folder)}", partial=trace)

        def killed(why: str) -> EngineFailed:
            procs.kill_group(proc)
            for pos in asm.emit(asm.complete_by_fields(asm.next_t)):  # what it wrote whole before it hung
                if req.on_position:
                    req.on_position(pos)
            return fail(why)

        def unreadable(why: str) -> EngineFailed:
            procs.kill_group(proc)
            e = EngineFailed(f"process engine {inert(self.name)}: {why} (the files are kept)", partial=trace)
            e.keep_folder = True  # the evidence: the message names the file
            return e

        try:
            while True:
                if req.cancel is not None and req.cancel.is_set():
                    procs.kill_group(proc)
                    raise Cancelled()
                rc = proc.poll()  # before reading: once it has exited, one more read gets everything
                try:
                    # the dump first: a record is written before the next key's line, so reading the
                    # sidecar second sees every record of each position the dump shows complete
                    lines = tail.poll()
                    records = list(side.poll()) if side else []
                    behind = side is not None and not side.caught_up  # more records wait: read them first
                    dump_behind = not tail.caught_up
                    if rc == 0 and not behind and not dump_behind:
                        lines += tail.finish()
                        if side:
                            side.check_end()
                except (DumpError, SidecarError) as e:
                    raise unreadable(str(e)) from None
                if lines or records:
                    last_new = time.monotonic()
                try:
                    for tag, a, off in records:
                        asm.add_raw(tag, a, off)
                    for n, tag, h in lines:
                        asm.add_hash(n, tag, h)
                except _ContentError as e:
                    raise unreadable(str(e)) from None
                upto = asm.ready(exited=rc == 0 and not behind and not dump_behind,
                                 raw_behind=asm.raw_hi if behind else None)
                if rc is not None and rc != 0 and not behind and not dump_behind:
                    upto = asm.complete_by_fields(upto)  # a crash leaves its last position unfinished, unless
                for pos in asm.emit(upto):               # the declared fields say it was whole
                    if req.on_position:
                        req.on_position(pos)
                    if req.cancel is not None and req.cancel.is_set():
                        procs.kill_group(proc)
                        raise Cancelled()
                    if req.stop is not None and req.stop():
                        return trace  # the caller has what it needs (finally kills the child)
                if behind or dump_behind:
                    continue  # catch up with the files before judging the end or sleeping
                if asm.beyond:
                    if asm.hi < 0:  # not one key in range: the engine numbers its positions otherwise
                        raise fail(f"its first key {_tag(asm.beyond)} is past the last position asked for"
                                   f" ({asm.last}); it runs its own, longer prompt: make the session's prompt"
                                   f" as long as the engine's, or pass {{prompt_ids}}")
                    return trace  # every asked-for position is in; the rest is not wanted
                if rc is not None:
                    if rc != 0:
                        raise fail(_exit_text(rc))
                    if tail.n_lines == 0:
                        where = f"${self.cfg.dump_env}" if self.cfg.dump_env else "{dump}"
                        raise fail(f"exited 0 but wrote no dump lines to {where} (is that the file it writes?)")
                    return trace
                now = time.monotonic()
                if self.cfg.timeout is not None and now - start > self.cfg.timeout:
                    raise killed(f"timed out after {_s(self.cfg.timeout)} s (timeout); killed it")
                if self.cfg.idle_timeout is not None and now - last_new > self.cfg.idle_timeout:
                    raise killed(f"wrote nothing for {_s(self.cfg.idle_timeout)} s (idle_timeout); killed it")
                if req.cancel is not None:
                    req.cancel.wait(POLL_S)
                else:
                    time.sleep(POLL_S)
        finally:
            tail.close()
            if side:
                side.close()
