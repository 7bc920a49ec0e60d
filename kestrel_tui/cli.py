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
import signal
import sys

from . import procs
from .engines.decoders import CPU_IMPLS
from .engines.registry import names
from .errors import UsageError
from .text import inert
from .terminal import err_console


def _model_args(p: argparse.ArgumentParser) -> None:
    # unset flags stay None: a --profile may set them, else session/inputs.py DEFAULTS apply (run_config)
    p.add_argument("--profile", metavar="FILE.toml", help="a TOML profile naming the reference, the subject"
                   " and its toggles (docs/profiles.md); the flags given here win over it")
    p.add_argument("--model", metavar="PATH", help="HF model directory (config.json + *.safetensors) or a"
                   " .gguf file; default: the embedded synthetic Qwen3-MoE")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt-ids", metavar="1,2,3", help="prompt as comma-separated token ids")
    g.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the model's tokenizer.json)")
    p.add_argument("--tokens", metavar="N", help="tokens to generate (default 16)")
    p.add_argument("--weights", choices=("q4_0", "f32"), help="weight format (default q4_0)")
    p.add_argument("--kv", choices=("q8", "f32"), help="KV cache format (default q8)")
    p.add_argument("--deep", action="store_true", default=None,
                   help="also probe MoE internals and pre-quantization K")
    p.add_argument("--cpu-impl", choices=CPU_IMPLS, help="the cpu engine's implementation of the contract"
                   " (the same bits): auto (default) takes the compiled one where it is built, numpy the numpy one")
    p.add_argument("--reference", dest="renamed_reference", help=argparse.SUPPRESS)  # the old --cpu-impl
    p.add_argument("--cuda-options", metavar="NAME=on|off,...", help="a cuda side's runtime switches (the same"
                   " bits either way): graph, pdl, fuse, pv_spread")
    p.add_argument("--no-cache", action="store_true", help="compute the reference even when the reference cache"
                   " (~/.cache/kestrel-tui/reference) holds it")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kestrel-tui", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")

    p = sub.add_parser("tui", help="the interactive debugger (default)")
    _model_args(p)
    p.add_argument("--subject", choices=("auto", *names(flag_subject=True)),
                   help="auto (default): cuda when usable, else sim; hf: transformers on --model's HF dir")

    p = sub.add_parser("dump", help="write a reference L2 dump file (<tag> <hash16> per key)")
    _model_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="dump file to create (never overwritten)")
    p.add_argument("--backend", default=None, help="cpu (reference, default), sim, cuda or hf; with --profile:"
                   " reference or subject (default subject)")
    p.add_argument("--exact", help="exact toggles: all (the built-ins' default), none or a list; with"
                   " --profile the side's own settings unless given")

    p = sub.add_parser("generate", help="greedy-decode with the reference and print the tokens")
    _model_args(p)

    p = sub.add_parser("diff", help="compare two dump files (or serving engines' dump folders); exit 0 identical,"
                       " 1 DIFF, 2 bad input")
    p.add_argument("a", metavar="A", help="a dump file, or a vLLM / SGLang dump folder (docs/engines-serving-dumps.md)")
    p.add_argument("b", metavar="B")
    p.add_argument("--tol", metavar="SPEC", help="two dump folders: judge the DIFF keys with their raw values, as"
                   " for run; exit 0 when every one is close")
    p.add_argument("--tui", action="store_true", help="open the grid over the two files")

    p = sub.add_parser("run", help="reference vs subject, headless; exit 0 all ok, 1 DIFF, 2 bad input,"
                       " 3 an engine failed")
    _model_args(p)
    p.add_argument("--subject", help="sim (default), cuda or hf; a profile names any engine")
    p.add_argument("--exact", help="the subject's toggles switched to exact: all, none or a comma list"
                   " (default: each toggle's default, all fast for the built-ins)")
    p.add_argument("--toggle", action="append", default=[], metavar="NAME=VALUE",
                   help="set one of the subject's toggles to a value (after --exact; repeatable),"
                   " e.g. --toggle dtype=bfloat16")
    p.add_argument("--mode", choices=("chain", "isolate"), default="chain")
    p.add_argument("--prefill", choices=("reference", "subject"), default="reference")
    p.add_argument("--forcing", choices=("teacher", "free"), default="teacher")
    p.add_argument("--tol", metavar="SPEC", help="judge DIFF keys with raw values close/far: nmse=1e-7 (the default"
                   " criterion), ulp=N, rel=X, comma-combined (all must hold); exit 0 when every DIFF key is close,"
                   " 1 when one is far or could not be judged")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("bisect", help="switch ops to exact one by one until all keys agree")
    _model_args(p)
    p.add_argument("--subject", help="sim (default), cuda or hf; a profile names any engine")
    p.add_argument("--target", choices=("ok", "far"), default="ok",
                   help="ok: until all keys agree (default); far: until no key is far (see --tol)")
    p.add_argument("--tol", metavar="SPEC", help="with --target far: the tolerance, as for run (default nmse=1e-7)")
    p.add_argument("--prefill", choices=("reference", "subject"), default="reference")
    p.add_argument("--forcing", choices=("teacher", "free"), default="teacher")
    p.add_argument("--exact", help="the toggles exact at the start: all, none or a comma list (default: each"
                   " toggle's default)")
    p.add_argument("--toggle", action="append", default=[], metavar="NAME=VALUE",
                   help="a toggle's value at the start (repeatable), e.g. --toggle dtype=bfloat16")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("graft", help="the cause test: graft the reference's values at the first far key, rerun,"
                       " and name every source in order; exit 0 when all are found, 1 when the limit left one")
    _model_args(p)
    p.add_argument("--subject", help="sim (default) or hf; a profile names any engine that takes a graft")
    p.add_argument("--tol", metavar="SPEC", help="the tolerance a source is far by (default nmse=1e-7; the"
                   " profile's); --target ok follows DIFF keys instead")
    p.add_argument("--target", choices=("far", "ok"), default="far",
                   help="far: graft far keys until every key is ok or close (default); ok: until all keys agree")
    p.add_argument("--key", metavar="KEY", help="the first key to graft (default: the first far, or first DIFF)")
    p.add_argument("--limit", default=8, help="sources grafted at most (default 8)")
    p.add_argument("--exact", help="the subject's toggles switched to exact, as for run")
    p.add_argument("--toggle", action="append", default=[], metavar="NAME=VALUE", help="as for run")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("repro", help="a repro bundle of one key: the op's inputs and outputs from both sides,"
                       " case.json and a numpy-only replay.py that prints the same verdict (docs/repro.md)")
    _model_args(p)
    p.add_argument("out", metavar="FOLDER", help="the bundle folder to create (never overwritten)")
    p.add_argument("--subject", help="sim (default), cuda or hf; a profile names any engine")
    p.add_argument("--key", metavar="KEY", help="the key (default: the first far key, the first DIFF without --tol)")
    p.add_argument("--tol", metavar="SPEC", help="the verdict's tolerance, as for run (default: the profile's, else"
                   " the bits)")
    p.add_argument("--max-mb", default=64.0, metavar="MB", help="refuse a bundle larger than this"
                   " (default 64; a q4_0 lm_head at Qwen3-30B-A3B's vocab is ~168)")
    p.add_argument("--mode", choices=("chain", "isolate"), default="chain")
    p.add_argument("--exact", help="the subject's toggles switched to exact, as for run")
    p.add_argument("--toggle", action="append", default=[], metavar="NAME=VALUE", help="as for run")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("sweep", help="one setting over its values: per value the first DIFF, first far, far count,"
                       " logits NMSE and flips, marking where the answer changes (docs/sweep.md); exit 1 if it does")
    _model_args(p)
    p.add_argument("--subject", help="sim (default), cuda or hf; a profile names any engine")
    p.add_argument("--what", required=True, metavar="SETTING", help="toggle:NAME (a subject toggle), m (the"
                   " batch-verify width), prompt (the prompt length) or batch (hf: the prompt among N others)")
    p.add_argument("--values", metavar="LIST", help="comma-separated, ranges A..B (1..8); default: the setting's own")
    p.add_argument("--tol", metavar="SPEC", help="the tolerance far is judged by, as for run (default nmse=1e-7;"
                   " the profile's)")
    p.add_argument("--exact", help="the subject's other toggles switched to exact, as for run")
    p.add_argument("--toggle", action="append", default=[], metavar="NAME=VALUE", help="as for run")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("iso", help="batch-verify (M columns) vs M=1 decode, full logits byte by byte")
    _model_args(p)
    p.add_argument("--subject", help="sim (default) or cuda")
    p.add_argument("--m", default=5, help="batch-verify width M")
    p.add_argument("--exact", default="none")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("export", help="write the model as a GGUF file (llama.cpp reads the same bytes)")
    p.add_argument("--model", metavar="PATH", help="HF model directory or .gguf file; default: the embedded"
                   " synthetic Qwen3-MoE")
    p.add_argument("--weights", choices=("q4_0", "f32"), default="q4_0",
                   help="tensor type of every matrix: Q4_0 (default) or F32")
    p.add_argument("--out", required=True, metavar="FILE.gguf", help="GGUF file to create (never overwritten)")

    p = sub.add_parser("bench", help="print speed figures")
    _model_args(p)
    p.add_argument("--what", choices=("reference", "toggle", "all"), default="reference")
    p.add_argument("--subject", choices=names(bench=True), default="cpu", help="cuda: full-size GPU decode figures")
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
    from . import commands
    from .engines import process

    procs.sweep()  # what a tool killed before it could clean up left behind
    # the app puts its own handlers in place while it runs (app/app.py); these cover the rest
    old = stop_on_signals()
    if args.cmd != "tui" and not getattr(args, "tui", False):
        process.announce = _say  # a profile's command is named on stderr before it runs
        process.reset_announced()
    try:
        check_options(args)
        return getattr(commands, f"cmd_{args.cmd}")(args, run_config_of(args))
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


def _checked_options() -> dict:
    """dest -> (flag, check): the options whose text is checked once parsed, so that a refused value is
    one line and exit 2 like every other bad input (argparse would print its usage and exit itself)."""
    from .engines.profile import TOKENS
    from .session.graft import LIMIT
    from .session.iso import WIDTH
    from .session.repro import MAX_MB

    return {"tokens": ("--tokens", TOKENS.parse), "limit": ("--limit", LIMIT.parse),
            "max_mb": ("--max-mb", MAX_MB.parse), "m": ("--m", WIDTH.parse), "key": ("--key", _key)}


def _key(text: str, flag: str) -> str:
    if not text.strip():
        raise UsageError(f"{flag} {text!r}: no key named; name one (t<T>_l<L>_<field>, t<T>_emb, t<T>_logits),"
                         f" or leave {flag} out for the first far key")
    return text


def check_options(args: argparse.Namespace) -> None:
    """Each checked option given (or defaulted) replaced by its checked value; else UsageError."""
    for dest, (flag, check) in _checked_options().items():
        if getattr(args, dest, None) is not None:
            setattr(args, dest, check(getattr(args, dest), flag))


def run_config_of(args: argparse.Namespace):
    """The run's settings, once: the command's model options over its --profile (session/inputs.py);
    None for a command that loads no model (diff)."""
    from .session.inputs import run_config

    if not hasattr(args, "model"):
        return None
    if getattr(args, "renamed_reference", None):
        raise UsageError(f"--reference {args.renamed_reference}: the option is now --cpu-impl (it picks the cpu"
                         f" engine's implementation; the reference side is a profile's [reference]); use"
                         f" --cpu-impl {args.renamed_reference}")
    return run_config(profile=getattr(args, "profile", None), model=args.model, weights=args.weights,
                      kv=getattr(args, "kv", None), deep=getattr(args, "deep", None),
                      tokens=getattr(args, "tokens", None), prompt_ids=getattr(args, "prompt_ids", None),
                      prompt=getattr(args, "prompt", None), cpu_impl=getattr(args, "cpu_impl", None),
                      cuda_options=getattr(args, "cuda_options", None), tol=getattr(args, "tol", None),
                      no_cache=getattr(args, "no_cache", False), subject=getattr(args, "subject", None))


def _drop_working_directory() -> None:
    """Run as ``python -m kestrel_tui.cli``, the working directory leads sys.path, and a model folder's
    llama_cpp.py would be imported instead of the installed library; kestrel_tui is imported already."""
    import os

    cwd = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != cwd]


if __name__ == "__main__":
    _drop_working_directory()
    sys.exit(main())
