"""TOML profiles: one file names the reference, the subject and the subject's toggles.

`load_profile` reads and checks the file's structure and types (engine options are
checked by the engines when they are built; `located` puts the file and line in
front of such an error). Every error is one line, ``FILE:LINE: key: problem; fix``,
so the CLI prints it as is and the app shows it in its status line. Loading
never writes anything and never loads a model: a missing model path is an error
here, before anything slow. The format is described in docs/profiles.md.
"""
from __future__ import annotations

import bisect
import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..bounds import Number
from ..errors import UsageError
from ..readers import parse_toml, read_regular
from ..trace.compare import Tolerance
from ..trace.keys import MAX_INDEX
from .base import EngineSpec, Toggle
from .registry import ENGINE_TABLE, ENGINES, names as engine_names

SIDES = ("reference", "subject")

TOP_KEYS = ("description", "model", "weights", "kv", "tokens", "prompt", "prompt_ids", "tolerance", "deep",
            "reference", "subject", "toggle")
SIDE_KEYS = ("engine", "model", "options")
TOGGLE_KEYS = ("name", "key", "values", "fast", "exact", "default", "owns", "help")
CHOICES = {"weights": ("q4_0", "f32"), "kv": ("q8", "f32")}  # as the command line's --weights / --kv
# The tokens to generate, here and on the command line: a key's position is at most MAX_INDEX.
TOKENS = Number(whole=True, lo=1, hi=MAX_INDEX, unit="tokens")

# A toggle name travels in --exact lists and in the app's key bindings: no commas, spaces or '='.
_NAME = re.compile(r"[A-Za-z0-9_.\-]+\Z")
_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_TOML_END = re.compile(r"\s*\(at end of document\)\s*$")

Address = tuple  # ("subject", "options", "dtype") or ("toggle", 0, "exact"): a value's place in the document


class ProfileError(UsageError):
    """A profile problem, one line: ``FILE:LINE: key: problem; fix`` (``FILE: ...`` when no line fits)."""

    def __init__(self, message: str, file: str = "", line: int | None = None, key: str = ""):
        super().__init__(message)
        self.file, self.line, self.key = file, line, key


@dataclass(frozen=True)
class Profile:
    path: Path                          # as given (messages show it so)
    reference: EngineSpec
    subject: EngineSpec
    model: str | None = None            # absolute path; None: the embedded default
    weights: str | None = None          # None: not set here (the command line's default applies)
    kv: str | None = None
    tokens: int | None = None
    prompt_ids: list[int] | None = None
    prompt: str | None = None
    tolerance: Tolerance | None = None  # trace/compare.py; None: not set here
    deep: bool | None = None
    description: str | None = None
    lines: Mapping[Address, int] = field(default_factory=dict, repr=False, compare=False)  # where each key sits

    def line_of(self, *address) -> int | None:
        """The line of ``address``, else of its nearest enclosing table or key (inline tables sit on one line)."""
        return _line_of(self.lines, tuple(address))

    def where(self, side: str, option: str | None = None) -> str:
        """``FILE:LINE`` of ``[side.options] option`` (a subject toggle whose key is ``option`` counts too),
        else of the side's options table, else of the ``[side]`` table."""
        if side not in SIDES:
            raise ValueError(f"side {side!r}: want reference or subject")
        line = None
        if option is not None:
            if (side, "options", option) in self.lines:
                line = self.lines[(side, "options", option)]
            elif side == "subject":
                line = self._toggle_line(lambda t: t.key == option)
        if line is None:
            line = self.line_of(side, "options") if option is not None else self.line_of(side)
        return _at(self.path, line)

    def where_toggle(self, name: str) -> str:
        """``FILE:LINE`` of the ``[[toggle]]`` named ``name`` (else the file alone)."""
        return _at(self.path, self._toggle_line(lambda t: t.name == name))

    def _toggle_line(self, pick) -> int | None:
        for i, t in enumerate(self.subject.toggles or ()):
            if pick(t):
                return self.line_of("toggle", i, "key" if t.key is not None else "name")
        return None


def located(profile: Profile, side: str, err: UsageError, option_hint: str | None = None) -> ProfileError:
    """An engine's own error (make_engine's UsageError for a bad option) with the profile line in front.

    Without ``option_hint`` the first of the side's option names (or toggle keys) that the message
    mentions is taken: engines name the option they reject."""
    spec = profile.reference if side == "reference" else profile.subject
    option = option_hint
    if option is None:
        names = [*spec.options, *(t.key for t in spec.toggles or () if t.key)]
        text, best = str(err), None
        for n in names:
            m = re.search(rf"(?<![\w-]){re.escape(str(n))}(?![\w-])", text)
            if m and (best is None or m.start() < best[0]):
                best = (m.start(), n)
        option = best[1] if best else None
    where = profile.where(side, option)
    toggle = next((t.name for t in spec.toggles or () if option is not None and t.key == option), None)
    key = (f"{side}.options.{option}" if option is not None and option in spec.options
           else f"toggle {toggle}" if toggle is not None else side)
    return ProfileError(f"{where}: {key}: {err}", str(profile.path), _line_from(where), key)


def load_profile(path, model_override: str | None = None) -> Profile:
    """Read and check the profile at ``path``. ``model_override`` (the command line's --model, relative
    to the working directory) replaces the top-level ``model``; a side's own ``model`` is kept."""
    shown = str(path)
    p = Path(os.path.expanduser(shown))
    try:
        data = read_regular(p, 4 << 20, "profile")  # a FIFO or /dev/zero is refused, not read forever
    except FileNotFoundError:
        raise ProfileError(f"{shown}: not found; give the path of a .toml profile (examples in profiles/)",
                           shown) from None
    except IsADirectoryError:
        raise ProfileError(f"{shown}: is a directory; give the path of a .toml profile file", shown) from None
    except OSError as e:
        raise ProfileError(f"{shown}: cannot read ({e.strerror}); check the path and its permissions",
                           shown) from None
    try:
        text = data.decode("utf-8-sig")  # an editor's BOM is harmless
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ProfileError(f"{shown}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the file as UTF-8",
                           shown, line) from None
    try:
        doc = parse_toml(text, shown)  # nesting and digits beyond a profile's are one line
    except tomllib.TOMLDecodeError as e:
        raise _syntax_error(shown, text, e) from None
    try:
        lines = _scan(text)
    except (ValueError, IndexError, AttributeError, tomllib.TOMLDecodeError):
        lines = {}  # a shape the scanner misreads: errors lose their line, never the profile
    chk = _Checker(shown, p, lines)
    return chk.profile(doc, model_override)


# ---------------------------------------------------------------- checking


class _Checker:
    def __init__(self, shown: str, path: Path, lines: dict):
        self.shown, self.path, self.lines = shown, path, lines
        self.base = path.resolve().parent  # relative model paths are relative to the profile's folder

    def fail(self, address: tuple, problem: str, fix: str):
        key = _key_name(address)
        line = _line_of(self.lines, address) if address else None
        raise ProfileError(f"{_at(self.shown, line)}: {key}: {problem}; {fix}", self.shown, line, key)

    def known(self, table: Mapping, address: tuple, allowed: tuple, hints: Mapping[str, str] = {}):
        for k in table:
            if k in allowed:
                continue
            if k in hints:
                self.fail((*address, k), "unknown key", hints[k])
            close = difflib.get_close_matches(k, allowed, n=1, cutoff=0.6)
            self.fail((*address, k), "unknown key",
                      f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(allowed)}")

    def typed(self, table: Mapping, address: tuple, key: str, kind, what: str):
        v = table.get(key)
        if v is None:
            return None
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            self.fail((*address, key), f"is {_toml_type(v)}, want {what}", f"write e.g. {key} = {_example(what)}")
        return v

    def string(self, table: Mapping, address: tuple, key: str) -> str | None:
        v = self.typed(table, address, key, str, "a string")
        if v is not None and not v.strip():
            self.fail((*address, key), "is empty", f"give a value or remove {key}")
        return v

    def table(self, doc: Mapping, address: tuple, key: str) -> dict | None:
        v = doc.get(key)
        if v is not None and not isinstance(v, dict):
            self.fail((*address, key), f"is {_toml_type(v)}, want a table",
                      f"write it as a [{_key_name((*address, key))}] table")
        return v

    def resolve(self, value: str) -> Path:
        """A path the profile writes: ``~`` expanded, a relative one relative to the profile's folder."""
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else self.base / p

    def model(self, value: str, address: tuple) -> str:
        p = self.resolve(value)
        if not p.exists():
            self.fail(address, f"{p} does not exist",
                      f"give an HF model directory or a .gguf file (relative to {self.base}), or pass --model PATH")
        return str(p.resolve())

    def profile(self, doc: dict, model_override: str | None) -> Profile:
        self.known(doc, (), TOP_KEYS, {"toggles": "the subject's toggles are [[toggle]] tables"})
        s = {k: self.string(doc, (), k) for k in ("description", "model", "weights", "kv", "prompt", "tolerance")}
        for k, choices in CHOICES.items():
            if s[k] is not None and s[k] not in choices:
                self.fail((k,), f"{s[k]!r} is not one of {', '.join(choices)}", f"write {k} = \"{choices[0]}\"")
        tokens = self.typed(doc, (), "tokens", int, "a whole number")
        if tokens is not None and TOKENS.problem(tokens) is not None:
            self.fail(("tokens",), f"{tokens} {TOKENS.problem(tokens)}", f"write {TOKENS.allowed()}, e.g. tokens = 16")
        deep = self.typed(doc, (), "deep", bool, "true or false")
        prompt_ids = self.prompt_ids(doc)
        if prompt_ids is not None and s["prompt"] is not None:
            self.fail(("prompt",), "given with prompt_ids", "keep one of prompt and prompt_ids")
        tolerance = self.tolerance(s["tolerance"]) if s["tolerance"] is not None else None

        if model_override is not None:
            o = Path(os.path.expanduser(str(model_override)))
            if not o.exists():
                raise ProfileError(f"--model {model_override}: does not exist; give an HF model directory or"
                                   f" a .gguf file", self.shown)
            model = str(o.resolve())
        else:
            model = self.model(s["model"], ("model",)) if s["model"] is not None else None

        reference = self.side(doc, "reference", model)
        subject = self.side(doc, "subject", model)
        toggles = self.toggles(doc, subject)
        if toggles is not None:
            self.owns(toggles, subject)
            subject = EngineSpec(subject.engine, subject.model, subject.options, toggles)
        return Profile(self.path, reference, subject,
                       model, s["weights"], s["kv"], tokens, prompt_ids, s["prompt"], tolerance, deep,
                       s["description"], self.lines)

    def prompt_ids(self, doc: dict) -> list[int] | None:
        v = doc.get("prompt_ids")
        if v is None:
            return None
        if not isinstance(v, list) or not v:
            self.fail(("prompt_ids",), f"is {_toml_type(v) if not isinstance(v, list) else 'an empty array'},"
                      f" want an array of token ids", "write e.g. prompt_ids = [1, 2, 3]")
        for x in v:
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                self.fail(("prompt_ids",), f"{x!r} is not a token id (a whole number >= 0)",
                          "write e.g. prompt_ids = [1, 2, 3]")
        return list(v)

    def tolerance(self, spec: str) -> Tolerance:
        from ..trace.compare import parse_tolerance

        try:
            return parse_tolerance(spec)
        except UsageError as e:
            msg = str(e)
            prefix = f"--tol {spec!r}: "  # parse_tolerance speaks to the command line
            msg = msg[len(prefix):] if msg.startswith(prefix) else msg
            self.fail(("tolerance",), f"{spec!r}: {msg}", 'e.g. tolerance = "nmse=1e-7" (see docs/profiles.md)')

    def side(self, doc: dict, side: str, model: str | None) -> EngineSpec:
        t = self.table(doc, (), side)
        if t is None:
            raise ProfileError(f"{self.shown}: {side}: missing; add a [{side}] table with engine = \"cpu\""
                               f" (one of {', '.join(ENGINES)})", self.shown, None, side)
        self.known(t, (side,), SIDE_KEYS,
                   {"toggle": ("the reference's toggles are fixed: set its options in [reference.options]"
                               if side == "reference" else "the subject's toggles are top-level [[toggle]] tables"),
                    "toggles": "the subject's toggles are top-level [[toggle]] tables"})
        engine = self.string(t, (side,), "engine")
        if engine is None:
            self.fail((side,), "no engine", f"add engine = \"cpu\" (one of {', '.join(ENGINES)})")
        if engine not in ENGINES:
            close = difflib.get_close_matches(engine, ENGINES, n=1, cutoff=0.5)
            self.fail((side, "engine"), f"unknown engine {engine!r}",
                      (f"did you mean {close[0]!r}? " if close else "") + f"choose from {', '.join(ENGINES)}")
        own = self.string(t, (side,), "model")
        side_model = self.model(own, (side, "model")) if own is not None else model
        options = self.table(t, (side,), "options") or {}
        if "schedule" in options:
            from .schedule import schedule_problem

            if not ENGINE_TABLE[engine].schedules:
                self.fail((side, "options", "schedule"), f"engine {engine} runs its own passes",
                          "remove it; a schedule is for " + ", ".join(engine_names(schedules=True)))
            problem = schedule_problem(options["schedule"])
            if problem:
                from .schedule import GRAMMAR

                self.fail((side, "options", "schedule"), f"{options['schedule']!r} {problem}", f"write {GRAMMAR}")
        if any(k != "schedule" for k in options) and not ENGINE_TABLE[engine].options:
            self.fail((side, "options"), f"engine {engine} takes no options but schedule",
                      "remove them; its toggles are the op families")
        if engine == "cuda":  # its runtime switches (backends/cuda/options.py), checked before any load
            from dataclasses import fields

            from ..backends.cuda.options import CudaOptions

            names = [f.name for f in fields(CudaOptions)]
            for name, value in options.items():
                if name == "schedule":
                    continue
                if name not in names:
                    self.fail((side, "options", name), f"{name!r} is not a cuda option",
                              f"choose from {', '.join(names)}")
                try:
                    CudaOptions().set({name: value})
                except UsageError:
                    self.fail((side, "options", name), f"{value!r} is not on or off", "write on or off")
        if engine == "process":
            self.no_nul(options, (side, "options"))
            options = self.process_cwd(options, (side, "options", "cwd"))
        return EngineSpec(engine, side_model, options, None)

    def no_nul(self, value, address: tuple) -> None:
        """A NUL byte cannot reach a program's argv or environment (the OS ends the string there)."""
        if isinstance(value, str):
            if "\0" in value:
                self.fail(address, "holds a NUL byte (\\0), which no command or environment can carry",
                          "remove it")
        elif isinstance(value, dict):
            for k, v in value.items():
                self.no_nul(k, address)
                self.no_nul(v, (*address, k))
        elif isinstance(value, list):
            for v in value:
                self.no_nul(v, address)

    def process_cwd(self, options: dict, address: tuple) -> dict:
        """A relative `cwd` is relative to the profile's folder, as a relative `model` is."""
        cwd = options.get("cwd")
        if not isinstance(cwd, str) or not cwd.strip():
            return options  # the process engine names what is wrong with it
        p = self.resolve(cwd)
        if not p.is_dir():
            self.fail(address, f"{p} is not a folder", f"give the folder the command runs in (relative to {self.base})")
        return {**options, "cwd": str(p)}

    def toggles(self, doc: dict, subject: EngineSpec) -> tuple[Toggle, ...] | None:
        entries = doc.get("toggle")
        if entries is None:
            return None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            self.fail(("toggle",), f"is {_toml_type(entries)}, want [[toggle]] tables",
                      "write each toggle as a [[toggle]] table")
        if ENGINE_TABLE[subject.engine].builtin and entries:
            self.fail(("toggle", 0), f"engine {subject.engine} has its own toggles (the op families)",
                      f"remove the [[toggle]] tables, or use an {_either(engine_names(builtin=False))} subject")
        out: list[Toggle] = []
        names: dict[str, int] = {}
        keys: dict[str, int] = {}
        env = subject.options.get("env") if subject.engine == "process" else None
        for i, e in enumerate(entries):
            a = ("toggle", i)
            self.known(e, a, TOGGLE_KEYS)
            t = self.toggle(e, a)
            if t.name in names:
                self.fail((*a, "name"), f"{t.name!r} is already the name of toggle[{names[t.name] + 1}]",
                          "give each toggle its own name")
            if t.key in keys:
                self.fail((*a, "key"), f"{t.key!r} is already set by toggle[{keys[t.key] + 1}]",
                          "one toggle per option")
            # one source of truth per setting: a fixed option and a toggle on the same key would fight
            if t.key in subject.options:
                self.fail(("subject", "options", t.key), f"is also set by toggle {t.name!r}",
                          f"remove it here; the toggle's default sets it (default = \"...\" picks which)")
            if isinstance(env, dict) and t.key in env:
                self.fail(("subject", "options", "env", t.key), f"is also set by toggle {t.name!r}",
                          "remove it here; the toggle's default sets it (default = \"...\" picks which)")
            names[t.name], keys[t.key] = i, i
            out.append(t)
        return tuple(out) if out else None

    def toggle(self, e: dict, a: tuple) -> Toggle:
        name = self.string(e, a, "name")
        if name is None:
            self.fail(a, "no name", "add name = \"...\" (what the app shows and --exact takes)")
        if not _NAME.match(name):
            self.fail((*a, "name"), f"{name!r} has characters other than letters, digits, '_', '.', '-'",
                      "rename it (it is typed in --exact lists)")
        key = self.string(e, a, "key")
        if key is None:
            self.fail(a, "no key", "add key = \"...\" (the hf option, or the env var / flag a process reads)")
        fast, exact, default = (self.string(e, a, k) for k in ("fast", "exact", "default"))
        help_ = self.typed(e, a, "help", str, "a string") or ""
        values = e.get("values")
        if values is not None:
            if fast is not None:
                self.fail((*a, "fast"), "given with values",
                          "give values (a list; exact optional) or fast and exact, not both")
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                self.fail((*a, "values"), "want an array of strings",
                          'write e.g. values = ["float32", "bfloat16"] (quote numbers: "0", "1")')
            if len(values) < 2:
                self.fail((*a, "values"), f"has {len(values)} value{'s' if len(values) != 1 else ''}",
                          "a toggle switches between at least two values")
            dup = next((v for j, v in enumerate(values) if v in values[:j]), None)
            if dup is not None:
                self.fail((*a, "values"), f"{dup!r} is given twice", "list each value once")
            if exact is not None and exact not in values:
                self.fail((*a, "exact"), f"{exact!r} is not among values {values}",
                          "make exact one of the values, or drop it (a list toggle)")
        else:
            if fast is None or exact is None:
                missing = "exact" if fast is not None else "fast" if exact is not None else "values"
                self.fail(a, f"no {missing}", 'give fast = "..." and exact = "..." (a binary toggle)'
                          ' or values = [...] (a list toggle)')
            if fast == exact:
                self.fail((*a, "exact"), f"equals fast ({fast!r})", "a toggle switches between two values")
            values = [fast, exact]
        if default is not None:
            if default not in values:
                self.fail((*a, "default"), f"{default!r} is not among {values}", "make it one of the values")
            values = [default, *(v for v in values if v != default)]  # values[0] is the default
        owns = e.get("owns", [])
        if not isinstance(owns, list) or not all(isinstance(o, str) for o in owns):
            self.fail((*a, "owns"), "want an array of probe field names", 'write e.g. owns = ["attn", "qrope"]')
        self.no_nul(values, (*a, "values"))
        self.no_nul(key, (*a, "key"))
        return Toggle(name, tuple(values), exact, tuple(owns), help_, key)

    def owns(self, toggles: tuple[Toggle, ...], subject: EngineSpec) -> None:
        """Every toggle's `owns` names a field the subject can make: bisection follows a first DIFF's
        field to its owners, so a misspelt one would never be tried first."""
        from ..trace.keys import ALL_FIELDS

        declared = subject.options.get("fields") if subject.engine == "process" else None
        known = (*ALL_FIELDS, "emb", "logits", *(f for f in declared or () if isinstance(f, str)))
        for i, t in enumerate(toggles):
            for f in t.owns:
                if f not in known:
                    close = difflib.get_close_matches(f, known, n=1, cutoff=0.6)
                    self.fail(("toggle", i, "owns"), f"{f!r} is not a probe field",
                              f"did you mean {close[0]!r}?" if close else
                              f"the fields are {', '.join(ALL_FIELDS)}, emb, logits (and a process's own `fields`)")


# ---------------------------------------------------------------- messages


def _either(words) -> str:
    """("a", "b", "c") -> "a, b or c"."""
    return " or ".join(filter(None, (", ".join(words[:-1]), words[-1])))


def _at(shown, line: int | None) -> str:
    return f"{shown}:{line}" if line is not None else str(shown)


def _line_from(where: str) -> int | None:
    head, _, tail = where.rpartition(":")
    return int(tail) if head and tail.isdigit() else None


def _key_name(address: tuple) -> str:
    """("toggle", 2, "exact") -> toggle[3].exact (entries count from 1, as a reader counts them)."""
    out = ""
    for part in address:
        out += f"[{part + 1}]" if isinstance(part, int) else (("." if out else "") + _quote_key(part))
    return out or "profile"


def _quote_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_\-]+", k) else '"' + k.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_type(v) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "a whole number"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "a table"
    return "a date/time"


def _example(what: str) -> str:
    return {"a string": '"..."', "a whole number": "16", "true or false": "true"}.get(what, "...")


def _syntax_error(shown: str, text: str, e: tomllib.TOMLDecodeError) -> ProfileError:
    msg = str(e)
    m = _TOML_AT.search(msg)
    if m:
        line, col = int(m.group(1)), int(m.group(2))
        problem = msg[:m.start()]
    else:
        line, col = text.rstrip().count("\n") + 1, None  # the last line with text on it
        problem = _TOML_END.sub("", msg)
        problem += " (at the end of the file)"
    problem = problem[:1].lower() + problem[1:]
    if col is not None:
        problem += f" at column {col}"
    return ProfileError(f"{shown}:{line}: TOML syntax: {problem}; fix that line"
                        f" (strings need quotes, arrays brackets, one key per line)", shown, line, "TOML syntax")


# ---------------------------------------------------------------- locating keys
#
# tomllib gives no positions for values, so a small scanner over the (already valid)
# text records the line where each table header and each key appears. Arrays of tables
# count their entries, so ("toggle", 1, "exact") is the `exact` of the second [[toggle]].
# Keys inside inline tables are not recorded: `_line_of` falls back to the enclosing key,
# which is on the same line (an inline table is one line in TOML 1.0).


def _line_of(lines: Mapping, address: tuple) -> int | None:
    while address:
        if address in lines:
            return lines[address]
        address = address[:-1]
    return None


def _scan(text: str) -> dict:
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    lineno = lambda pos: bisect.bisect_right(starts, pos)  # noqa: E731
    lines: dict[tuple, int] = {}
    arrays: dict[tuple, int] = {}  # array-of-tables path -> index of its current entry
    table: tuple = ()
    n, i = len(text), 0

    def note(addr, pos):
        lines.setdefault(addr, lineno(pos))

    def resolve(segs) -> tuple:
        out: list = []
        for s in segs:
            out.append(s)
            if tuple(out) in arrays:
                out.append(arrays[tuple(out)])
        return tuple(out)

    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
        elif c == "#":
            i = _eol(text, i)
        elif c == "[":
            double = text.startswith("[[", i)
            segs, i = _key(text, i + (2 if double else 1))
            i = text.index("]]" if double else "]", i) + (2 if double else 1)
            start = lineno(i - 1)
            if double:
                parent = resolve(segs[:-1])
                path = (*parent, segs[-1])
                arrays[path] = arrays.get(path, -1) + 1
                table = (*path, arrays[path])
                lines.setdefault(path, start)
            else:
                table = resolve(segs)
            for k in range(1, len(table) + 1):
                lines.setdefault(table[:k], start)
        else:
            start = i
            segs, i = _key(text, i)
            i = text.index("=", i) + 1
            for k in range(1, len(segs) + 1):
                note((*table, *segs[:k]), start)
            i = _skip_value(text, i)
    return lines


def _eol(text: str, i: int) -> int:
    j = text.find("\n", i)
    return len(text) if j < 0 else j


def _key(text: str, i: int) -> tuple[list[str], int]:
    """A dotted key starting at ``i`` -> its segments and the position after it."""
    segs: list[str] = []
    while True:
        while text[i] in " \t":
            i += 1
        if text[i] == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            segs.append(tomllib.loads(f"k = {text[i:j + 1]}")["k"])  # let tomllib decode the escapes
            i = j + 1
        elif text[i] == "'":
            j = text.index("'", i + 1)
            segs.append(text[i + 1:j])
            i = j + 1
        else:
            m = re.compile(r"[A-Za-z0-9_\-]+").match(text, i)
            segs.append(m.group(0))
            i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == ".":
            i += 1
            continue
        return segs, i


def _skip_value(text: str, i: int) -> int:
    """The position of the newline that ends the value starting at ``i`` (arrays may span lines)."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "'":
            i = _skip_string(text, i)
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "#":
            i = _eol(text, i)
            continue
        elif c == "\n" and depth <= 0:
            return i
        i += 1
    return i


def _skip_string(text: str, i: int) -> int:
    q = text[i]
    if text.startswith(q * 3, i):
        j = i + 3
        while not text.startswith(q * 3, j):
            j += 2 if q == '"' and text[j] == "\\" else 1
        j += 3
        while j < len(text) and text[j] == q:  # up to two quotes may end the content: """a""""
            j += 1
        return j
    j = i + 1
    while text[j] != q:
        j += 2 if q == '"' and text[j] == "\\" else 1
    return j + 1
