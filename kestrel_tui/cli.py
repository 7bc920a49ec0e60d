"""`kestrel-tui` command line: the app by default, and headless subcommands.

Every failure the user can cause ends in one line on stderr and exit status 2
(outside text in it inert: text.py); an engine that fails (a crash, a timeout,
nothing written) exits 3, with `failed` in --json naming the side and the reason.
`diff` and `run` exit 1 when they find a DIFF and 0 when all keys agree
(`run --tol SPEC`: 1 when a key is far or a DIFF could not be judged, which the
output says, and 0 when every key is ok or close).

SIGTERM and SIGHUP stop a command like Ctrl-C (exit 130, an unfinished output kept
as .partial); the app quits on them as on `q`. Either way, and however a command
ends, every engine process group still running is killed and the private
temporary folders are removed (procs.py); folders a killed tool left behind are
removed at the next start.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from . import commands, procs
from .backends.cuda.options import CudaOptions
from .engines.decoders import CPU_IMPLS
from .engines.profile import CHOICES, TOKENS
from .engines.registry import names
from .errors import UsageError
from .session.graft import DEFAULT_LIMIT, LIMIT
from .session.inputs import DEFAULT_SUBJECT, DEFAULTS, run_config
from .session.iso import DEFAULT_WIDTH, WIDTH
from .session.repro import DEFAULT_MAX_MB, MAX_MB
from .session.session import FORCINGS, MODES, PREFILLS
from .text import inert
from .terminal import err_console


# ---- the command line's vocabulary: every option once, every command a list of them

@dataclass(frozen=True)
class Arg:
    """One option: its flags, argparse's keywords (one default, from the constant it stands for) and the
    check its text goes through once parsed (a refusal is one line and exit 2, as any bad input is)."""
    flags: tuple[str, ...]
    kw: Mapping[str, object] = field(default_factory=dict)
    check: Callable[[object, str], object] | None = None
    name: str = ""  # the table's name for it, where two options share a dest (--out, repro's FOLDER)

    @property
    def dest(self) -> str:
        return str(self.kw.get("dest") or self.flags[0].lstrip("-").replace("-", "_"))

    @property
    def key(self) -> str:
        return self.name or self.dest


def _key(text: str, flag: str) -> str:
    if not text.strip():
        raise UsageError(f"{flag} {text!r}: no key named; name one (t<T>_l<L>_<field>, t<T>_emb, t<T>_logits),"
                         f" or leave {flag} out for the first far key")
    return text


_SUBJECTS = names(flag_subject=True)
_TOL_GRAMMAR = ("SPEC: nmse=X (the default criterion), ulp=N, rel=X, comma-combined (all must hold), then"
                " PATTERN:CRITERIA rules for some keys (docs/profiles.md)")

ARGS: dict[str, Arg] = {a.key: a for a in (
    # the run's inputs; unset ones stay None: a --profile may set them, else session/inputs.py DEFAULTS apply
    Arg(("--profile",), dict(metavar="FILE.toml", help="a TOML profile naming the reference, the subject and its"
                             " toggles (docs/profiles.md); the flags given here win over it")),
    Arg(("--model",), dict(metavar="PATH", help="HF model directory (config.json + *.safetensors) or a .gguf file;"
                           " default: the embedded synthetic Qwen3-MoE")),
    Arg(("--prompt-ids",), dict(metavar="1,2,3", help="prompt as comma-separated token ids")),
    Arg(("--prompt",), dict(metavar="TEXT", help="prompt text (needs the model's tokenizer.json)")),
    Arg(("--tokens",), dict(metavar="N", help=f"tokens to generate (default {DEFAULTS['tokens']})"), TOKENS.parse),
    Arg(("--weights",), dict(choices=CHOICES["weights"], help=f"weight format (default {DEFAULTS['weights']})")),
    Arg(("--kv",), dict(choices=CHOICES["kv"], help=f"KV cache format (default {DEFAULTS['kv']})")),
    Arg(("--deep",), dict(action="store_true", default=None, help="also probe MoE internals and pre-quantization K")),
    Arg(("--cpu-impl",), dict(choices=CPU_IMPLS, help=f"the cpu engine's implementation of the contract (the same"
                              f" bits): {CPU_IMPLS[0]} (default) takes the compiled one where it is built, numpy"
                              f" the numpy one")),
    Arg(("--reference",), dict(dest="renamed_reference", help=argparse.SUPPRESS)),  # the old --cpu-impl
    Arg(("--cuda-options",), dict(metavar="NAME=on|off,...", help=f"a cuda side's runtime switches (the same bits"
                                  f" either way): {', '.join(f.name for f in fields(CudaOptions))}")),
    Arg(("--schedule",), dict(metavar="S", help="the subject's schedule: decode (default), forward, chunked:N,"
                              " prefix:K or verify:M (docs/schedules.md)")),
    Arg(("--reference-schedule",), dict(metavar="S", help="the reference's schedule (default decode)")),
    Arg(("--no-cache",), dict(action="store_true", help="compute the reference even when the reference cache"
                              " (~/.cache/kestrel-tui/reference) holds it")),
    # the subject and how it runs
    Arg(("--subject",), dict(help=f"{', '.join(_SUBJECTS)} (default {DEFAULT_SUBJECT}); a profile names any"
                             f" engine")),
    Arg(("--exact",), dict(help="the subject's toggles switched to exact: all, none or a comma list (default: each"
                           " toggle's default, all fast for the built-ins)")),
    Arg(("--toggle",), dict(action="append", default=[], metavar="NAME=VALUE", help="set one of the subject's"
                            " toggles to a value (after --exact; repeatable), e.g. --toggle dtype=bfloat16")),
    Arg(("--mode",), dict(choices=MODES, default=MODES[0], help=f"{MODES[0]} (default): every op reads the"
                          f" subject's own inputs; {MODES[1]}: the reference's, so a DIFF is the op's own")),
    Arg(("--prefill",), dict(choices=PREFILLS, default=PREFILLS[0], help=f"who runs the prompt: {PREFILLS[0]}"
                             f" (default: its KV rows are copied to the subject) or {PREFILLS[1]}")),
    Arg(("--forcing",), dict(choices=FORCINGS, default=FORCINGS[0], help=f"{FORCINGS[0]} (default): the subject"
                             f" consumes the reference's tokens; {FORCINGS[1]}: its own")),
    Arg(("--tol",), dict(metavar="SPEC")),  # its help says what it does in each command: COMMANDS
    Arg(("--target",), dict(choices=("ok", "far"))),
    Arg(("--key",), dict(metavar="KEY"), _key),
    Arg(("--json",), dict(action="store_true", help="print the result as JSON (machine-readable)")),
    # one command's own
    Arg(("--out",), dict(required=True, metavar="FILE")),
    Arg(("out",), dict(metavar="FOLDER", help="the bundle folder to create (never overwritten)"), name="bundle"),
    Arg(("--backend",), dict(help="cpu (reference, default), sim, cuda or hf; with --profile: reference or"
                             " subject (default subject)")),
    Arg(("a",), dict(metavar="A", help="a dump file, or a vLLM / SGLang dump folder"
                     " (docs/engines-serving-dumps.md)")),
    Arg(("b",), dict(metavar="B")),
    Arg(("--tui",), dict(action="store_true", help="open the grid over the two files")),
    Arg(("--limit",), dict(default=DEFAULT_LIMIT, metavar="N", help=f"sources grafted at most (default"
                           f" {DEFAULT_LIMIT})"), LIMIT.parse),
    Arg(("--max-mb",), dict(default=DEFAULT_MAX_MB, metavar="MB", help=f"refuse a bundle larger than this (default"
                            f" {DEFAULT_MAX_MB:g}; a q4_0 lm_head at Qwen3-30B-A3B's vocab is ~168)"), MAX_MB.parse),
    Arg(("--what",), dict(metavar="SETTING")),
    Arg(("--values",), dict(metavar="LIST", help="comma-separated, ranges A..B (1..8); default: the setting's own"
                            " (docs/sweep.md: how many a sweep takes)")),
    Arg(("--m",), dict(default=DEFAULT_WIDTH, metavar="M", help=f"batch-verify width (default {DEFAULT_WIDTH})"),
        WIDTH.parse),
)}

# the options of a command that runs a model; a tuple is a choice of one of them
RUN_INPUTS = ("profile", "model", ("prompt_ids", "prompt"), "tokens", "weights", "kv", "deep", "cpu_impl",
              "renamed_reference", "cuda_options", "no_cache", "schedule", "reference_schedule")
SUBJECT = ("subject", "exact", "toggle")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    args: tuple
    own: Mapping[str, Mapping[str, object]] = field(default_factory=dict)  # this command's words for an option
    tol: str | None = None  # what --tol does here; its default is commands.TOLERANCE_DEFAULT's


COMMANDS = (
    Command("tui", "the interactive debugger (default)", (*RUN_INPUTS, "subject"),
            {"subject": dict(choices=("auto", *_SUBJECTS), help="auto (default): cuda when usable, else sim; hf:"
                             " transformers on --model's HF dir")}),
    Command("dump", "write a reference L2 dump file (<tag> <hash16> per key)", (*RUN_INPUTS, "out", "backend", "exact"),
            {"out": dict(help="dump file to create (never overwritten)"),
             "exact": dict(help="exact toggles: all (the built-ins' default), none or a list; with --profile the"
                                " side's own settings unless given")}),
    Command("generate", "greedy-decode with the reference and print the tokens", RUN_INPUTS),
    Command("diff", "compare two dump files (or serving engines' dump folders); exit 0 identical, 1 DIFF, 2 bad"
            " input", ("a", "b", "tol", "tui"),
            tol="two dump folders: judge the DIFF keys with their raw values, as for run; exit 0 when every one is"
                " close"),
    Command("logprobs", "the RL logprob mismatch of two JSONL files of chosen-token log-probabilities (A the"
            " reference, B the subject): clip-band fractions, k1/k3, max |dp|, histogram; exit 0 every token"
            " the same float, 1 one differs, 2 bad input; with --profile or --model the worst sequence replayed"
            " and grafted", ("a", "b", "json", "profile", "model", "tol"),
            {"a": dict(metavar="A.jsonl", help='the reference (the rollout that chose the tokens): one'
                       ' {"token_ids": [...], "logprobs": [...]} a line (docs/schedules.md)'),
             "b": dict(metavar="B.jsonl", help="the subject (e.g. the trainer's forward); line i pairs with A's"
                       " line i, the same token ids or a suffix of them"),
             "profile": dict(help="replay the worst sequence (the largest |log-ratio|) on the profile's reference"
                             " and subject, its tokens forced on both, and graft from the first far key"),
             "model": dict(help="the model of the replay (HF directory or .gguf); the files' token ids are its")},
            tol="the tolerance the replay's first far key and graft judge by"),
    Command("run", "reference vs subject, headless; exit 0 all ok, 1 DIFF, 2 bad input, 3 an engine failed",
            (*RUN_INPUTS, *SUBJECT, "mode", "prefill", "forcing", "tol", "json"),
            tol="judge DIFF keys with raw values close/far; exit 0 when every DIFF key is close, 1 when one is far"
                " or could not be judged"),
    Command("bisect", "switch ops to exact one by one until all keys agree", (*RUN_INPUTS, *SUBJECT, "target", "tol",
            "prefill", "forcing", "json"),
            {"target": dict(default="ok", help="ok: until all keys agree (default); far: until no key is far (see"
                                               " --tol)"),
             "exact": dict(help="the toggles exact at the start: all, none or a comma list (default: each toggle's"
                                " default)")},
            tol="with --target far: the tolerance a key is far by"),
    Command("graft", "the cause test: graft the reference's values at the first far key, rerun, and name every"
            " source in order; exit 0 when all are found, 1 when the limit left one",
            (*RUN_INPUTS, *SUBJECT, "tol", "target", "key", "limit", "json"),
            {"subject": dict(help=f"{DEFAULT_SUBJECT} (default) or hf; a profile names any engine that takes a"
                                  f" graft"),
             "target": dict(default="far", help="far: graft far keys until every key is ok or close (default); ok:"
                                                " until all keys agree"),
             "key": dict(help="the first key to graft (default: the first far, or first DIFF)")},
            tol="the tolerance a source is far by; --target ok follows DIFF keys instead"),
    Command("repro", "a repro bundle of one key: the op's inputs and outputs from both sides, case.json and a"
            " numpy-only replay.py that prints the same verdict (docs/repro.md)",
            ("bundle", *RUN_INPUTS, *SUBJECT, "key", "tol", "max_mb", "mode", "json"),
            {"key": dict(help="the key (default: the first far key, the first DIFF without a tolerance)")},
            tol="the verdict's tolerance"),
    Command("sweep", "one setting over its values: per value the first DIFF, first far, far count, logits NMSE and"
            " flips, marking where the answer changes (docs/sweep.md); exit 1 if it does",
            (*RUN_INPUTS, *SUBJECT, "what", "values", "tol", "json"),
            {"what": dict(required=True, help="toggle:NAME (a subject toggle), m (the batch-verify width), prompt"
                                              " (the prompt length) or batch (hf: the prompt among N others)")},
            tol="the tolerance far is judged by"),
    Command("iso", "batch-verify (M columns) vs M=1 decode, full logits byte by byte", (*RUN_INPUTS, "subject",
            "exact", "m", "json"),
            {"subject": dict(help=f"{' or '.join(names(builtin=True, flag_subject=True))} (default"
                                  f" {DEFAULT_SUBJECT})"),
             "exact": dict(default="none", help="the subject's ops switched to exact: all, none (default) or a"
                                                " comma list")}),
    Command("export", "write the model as a GGUF file (llama.cpp reads the same bytes)", ("model", "weights", "out"),
            {"weights": dict(help=f"tensor type of every matrix: {CHOICES['weights'][0]} (default) or"
                                  f" {CHOICES['weights'][1]}"),
             "out": dict(metavar="FILE.gguf", help="GGUF file to create (never overwritten)")}),
    Command("bench", "print speed figures", (*RUN_INPUTS, "what", "subject"),
            {"what": dict(choices=("reference", "toggle", "all"), default="reference", metavar=None,
                          help="reference (default): the reference's decode step, beside transformers'; toggle:"
                               " the time from switching an op to its first DIFF (sim); all: both"),
             "subject": dict(choices=names(bench=True), default="cpu", help="cuda: full-size GPU decode figures")}),
)


def _tol_help(cmd: Command) -> str:
    default = commands.TOLERANCE_DEFAULT[cmd.name]
    fallback = "the bits (ok/DIFF)" if default is None else default.spec()
    return f"{cmd.tol}; default: the profile's tolerance, else {fallback}. {_TOL_GRAMMAR}"


def _add(p: argparse.ArgumentParser, cmd: Command, name: str) -> None:
    arg = ARGS[name]
    kw = {**arg.kw, **cmd.own.get(name, {})}
    if name == "tol":
        kw["help"] = _tol_help(cmd)
    kw = {k: v for k, v in kw.items() if v is not None or k == "default"}
    p.add_argument(*arg.flags, **kw)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kestrel-tui", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        for name in cmd.args:
            if isinstance(name, tuple):
                group = p.add_mutually_exclusive_group()
                for one in name:
                    _add(group, cmd, one)
            else:
                _add(p, cmd, name)
    return ap


ERROR_LIMIT = 2000  # characters of an error line: our words plus the outside text they quote, clipped
_stopping = False   # the command is ending: a stop signal now is ignored
_signalled = False  # one arrived: the process is ending


def _interrupt(signum, frame) -> None:
    global _stopping, _signalled
    _signalled = True
    if _stopping:
        return  # one is enough: a second must not cut the cleanup the first started short
    _stopping = True
    raise KeyboardInterrupt


def stop_on_signals() -> dict:
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does; the previous
    handlers, to put back."""
    global _stopping, _signalled
    _stopping = _signalled = False
    old = {}
    for sig in procs.STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):  # not the main thread: nothing to install
            old[sig] = signal.signal(sig, _interrupt)
    return old


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # a terminal that hung up: the command goes on
        err_console.print(line)


def main(argv: list[str] | None = None) -> int:
    global _stopping
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["tui", *argv]
    args = build_parser().parse_args(argv)
    from .engines import process

    procs.sweep()  # what a tool killed before it could clean up left behind
    # the app puts its own handlers in place while it runs (app/app.py); these cover the rest
    old = stop_on_signals()
    if args.cmd != "tui" and not getattr(args, "tui", False):
        process.announce = _say  # a profile's command is named on stderr before it runs
        process.reset_announced()
    try:
        check_options(args)
        status = getattr(commands, f"cmd_{args.cmd}")(args, run_config_of(args))
        sys.stdout.flush()  # a reader that went away shows here, not as a warning at exit
        return status
    except BrokenPipeError:
        # stdout's reader stopped reading (`| head`): end quietly, with the status of a tool that
        # SIGPIPE ended, and nothing more written where no one reads
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except UsageError as e:
        _say(f"kestrel-tui {args.cmd}: error: {inert(e, ERROR_LIMIT)}")
        return 2
    except KeyboardInterrupt as e:
        partial = getattr(e, "partial", None)  # set by files.create_whole
        _say("interrupted" + (f"; the unfinished output is kept as {partial} (not a whole file)"
                              if partial else ""))
        return 130
    finally:
        _stopping = True  # a signal now would cut the cleanup short; the command is ending anyway
        process.announce = None
        procs.cleanup()
        for sig, handler in old.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                # after a stop signal more may follow while the interpreter ends: the work is done
                signal.signal(sig, signal.SIG_IGN if _signalled else handler)


def check_options(args: argparse.Namespace) -> None:
    """Each checked option given (or defaulted) replaced by its checked value; else UsageError."""
    for arg in ARGS.values():
        if arg.check is not None and getattr(args, arg.dest, None) is not None:
            setattr(args, arg.dest, arg.check(getattr(args, arg.dest), arg.flags[0]))


def run_config_of(args: argparse.Namespace):
    """The run's settings, once: the command's model options over its --profile (session/inputs.py);
    None for a command that loads no model (diff)."""
    if not hasattr(args, "model"):
        return None
    if getattr(args, "renamed_reference", None):
        raise UsageError(f"--reference {args.renamed_reference}: the option is now --cpu-impl (it picks the cpu"
                         f" engine's implementation; the reference side is a profile's [reference]); use"
                         f" --cpu-impl {args.renamed_reference}")
    given = [n for item in (*RUN_INPUTS, "subject", "tol") for n in (item if isinstance(item, tuple) else (item,))]
    return run_config(**{name: getattr(args, name) for name in given
                         if name != "renamed_reference" and getattr(args, name, None) is not None})


def _drop_working_directory() -> None:
    """Run as ``python -m kestrel_tui.cli``, the working directory leads sys.path, and a model folder's
    llama_cpp.py would be imported instead of the installed library; kestrel_tui is imported already."""
    import os

    cwd = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != cwd]


if __name__ == "__main__":
    _drop_working_directory()
    sys.exit(main())
