"""The llama.cpp engine: llama-cpp-python's low-level API in-process as a run source.

llama.cpp decodes the GGUF itself; every probe key is read in ggml's eval
callback (`llama_context_params.cb_eval`): asked for each graph node, it says
yes only to the nodes of NODES (by name and op), then reads each one when it
is computed (engines/ggml_tensor.py). docs/engines-llamacpp.md has the node ->
key map, what has no node, and the options and toggles.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .. import procs
from ..backends.base import StepOut
from ..errors import UsageError
from ..text import inert
from ..trace.fnv import fnv1a64
from ..trace.keys import DEEP_FIELDS, FIELDS, layer_fields
from ..trace.rawstore import RawStore
from ..trace.run import Cancelled, Trace
from .base import (MOST_THREADS, Capabilities, Engine, EngineFailed, EngineSpec, RunRequest, Toggle,
                   check_toggle_keys)
from .decode import decode_loop
from .schedule import GRAMMAR, parse_schedule, schedule_problem

NEEDS = "llama.cpp engine needs llama-cpp-python: pip install -e '.[llama]' (or pip install llama-cpp-python)"
REBUILD = ("rebuild llama-cpp-python: CMAKE_ARGS=\"-DGGML_CUDA=on\""
           " pip install --no-binary llama-cpp-python llama-cpp-python")

KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type
LOG_WARN, LOG_ERROR, LOG_CONT = 3, 4, 5  # enum ggml_log_level (CONT: more of the previous message)
CUBLAS = ("auto", "f32", "f16", "bf16")
# option -> the values a toggle may take (None: a whole number, checked in _check_value), the default first
OPTIONS: dict[str, tuple[str, ...] | None] = {
    "n_ubatch": ("prompt", "1"),        # "prompt": the prompt length (one ubatch); or a whole number
    "flash_attn": ("off", "on"),
    "kv_type": tuple(KV_TYPES),         # sets type_k and type_v
    "type_k": tuple(KV_TYPES),
    "type_v": tuple(KV_TYPES),
    "n_threads": None,
    "n_gpu_layers": ("0", "all"),       # or a whole number 0..n_layers+1
    "op_offload": ("on", "off"),
    "repack": ("on", "off"),            # use_extra_bufts: weights repacked for AMX / CPU_REPACK kernels
    "attn_rot": ("on", "off"),          # LLAMA_ATTN_ROT_DISABLE, read when a KV cache is made
    "cublas_compute_type": CUBLAS,      # GGML_CUDA_CUBLAS_COMPUTE_TYPE, read on every cuBLAS call
    "schedule": ("decode",),            # or any schedule (engines/schedule.py), checked in _check_value
}
NUMBER = {"n_ubatch", "n_threads", "n_gpu_layers"}
EXACT = {"n_ubatch": "1", "flash_attn": "off", "kv_type": "f32", "type_k": "f32", "type_v": "f32"}
OWNS = {"n_ubatch": ("kraw", "v", "attn", "ores", "x"), "flash_attn": ("attn",), "kv_type": ("attn",),
        "type_k": ("attn",), "type_v": ("attn",)}
HELP = {
    "n_ubatch": "llama.cpp's physical batch: the prompt in one ubatch (prompt) or token by token (1)",
    "flash_attn": "flash_attn_type: ggml_flash_attn_ext instead of mul_mat + soft_max + mul_mat",
    "kv_type": "the KV cache's ggml type (type_k and type_v)",
    "type_k": "the K cache's ggml type", "type_v": "the V cache's ggml type",
    "n_threads": "CPU threads (n_threads and n_threads_batch)",
    "n_gpu_layers": "layers offloaded to the GPU (n_layers+1 or all: the output layer too)",
    "op_offload": "run host-weight ops of big batches on the GPU (llama.cpp's prefill placement)",
    "repack": "use_extra_bufts: quantized weights repacked for the CPU's AMX / repack kernels",
    "attn_rot": "Hadamard rotation of Q/K (V) before a quantized cache (LLAMA_ATTN_ROT_DISABLE=1: off)",
    "cublas_compute_type": "GGML_CUDA_CUBLAS_COMPUTE_TYPE for cuBLAS matmuls",
    "schedule": "which positions share a llama_decode: " + GRAMMAR,
}
# Environment read once per process by ggml (a static or std::call_once): settable only before llama.cpp
# first runs here, through the `env` option, never as a toggle.
ONCE_ENV = ("GGML_CPU_DISABLE_FUSION", "GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE", "GGML_CUDA_DISABLE_FUSION",
            "GGML_CUDA_DISABLE_GRAPHS", "GGML_CUDA_MMQ_PREC", "GGML_CUDA_GRAPH_OPT", "GGML_CUDA_PDL",
            "LLAMA_GRAPH_REUSE_DISABLE")
_ENV_AT_START: dict[str, str | None] | None = None  # ONCE_ENV as the first load in this process saw it

# graph node (name without "-<layer>") -> key field; Qcur / Kcur / Vcur go by op (_field)
NODES = {"attn_norm": "nrm", "Kcur_normed": "knorm", "kqv_out": "attn", "ffn_inp": "ores", "ffn_norm": "pnrm",
         "ffn_moe_logits": "router", "ffn_moe_topk": "topk", "ffn_moe_weights_norm": "topw",
         "ffn_moe_out": "moe", "ffn_out": "moe", "l_out": "x"}


def _llama():
    try:
        import llama_cpp
    except ImportError as e:
        if e.name in (None, "llama_cpp"):
            raise UsageError(NEEDS) from None
        raise UsageError(f"llama.cpp engine: llama-cpp-python does not import (no module {e.name!r}):"
                         f" pip install {e.name}") from None
    except OSError as e:  # the shared library itself
        raise UsageError(f"llama.cpp engine: llama-cpp-python's library does not load: {_line(e)}; {REBUILD}") \
            from None
    if "cb_eval" not in dict(llama_cpp.llama_context_params._fields_):
        raise UsageError(f"llama.cpp engine: this llama-cpp-python ({llama_cpp.__version__}) has no"
                         f" llama_context_params.cb_eval (the eval callback every key is read in);"
                         f" pip install -U llama-cpp-python")
    return llama_cpp


def _gpu(llama_cpp) -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


def _check_value(name: str, value: object, where: str = "option", gpu: bool = False, n_layers: int = 0) -> str:
    if name not in OPTIONS:
        raise UsageError(f"llama.cpp engine: unknown {where} {name!r}; choose from {', '.join([*OPTIONS, 'env'])}")
    if name == "schedule":
        why = schedule_problem(value)
        if why:
            raise UsageError(f"llama.cpp engine: schedule={value!r}: {why}; write {GRAMMAR}")
        return str(value)
    v = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    allowed = OPTIONS[name]
    lowest, most = (0, None) if name == "n_gpu_layers" else (1, MOST_THREADS if name == "n_threads" else None)
    if name in NUMBER and v is not None and v.isdigit() and lowest <= int(v) and (most is None or int(v) <= most):
        v = str(int(v))
    elif v is None or allowed is None or v not in allowed:
        shown = "|".join(allowed) if allowed else f"a whole number 1..{MOST_THREADS}"
        extra = " or a whole number >= 1" if name == "n_ubatch" else \
            f" or a whole number 0..{n_layers + 1}" if name == "n_gpu_layers" else ""
        raise UsageError(f"llama.cpp engine: {name}={value!r} is not allowed; choose from {shown}{extra}")
    if name == "n_gpu_layers" and v != "0":
        if not gpu:
            raise UsageError(f"llama.cpp engine: n_gpu_layers={v}, but this llama-cpp-python has no GPU backend"
                             f" (llama_supports_gpu_offload() is false); use n_gpu_layers=0, or {REBUILD}")
        if v != "all" and n_layers and int(v) > n_layers + 1:
            raise UsageError(f"llama.cpp engine: n_gpu_layers={v}: the model has {n_layers} layers;"
                             f" pick 0..{n_layers + 1} or all")
    return v


def default_repack() -> str:
    """llama.cpp repacks q4_0 weights for the CPU by default; on a CPU with AMX that path segfaults inside
    llama_decode for any batch of more than one token (measured on this project's machines, llama.cpp as
    vendored by llama-cpp-python 0.3.36: results/llamacpp-findings.md), taking the app with it. There the
    default is off (the plain q4_0 kernels); the option turns it back on."""
    try:
        with open("/proc/cpuinfo") as f:
            amx = any("amx_int8" in line for line in f if line.startswith("flags"))
    except OSError:
        amx = False
    return "off" if amx else "on"


def parse_options(options: Mapping[str, object], gpu: bool, n_layers: int) -> tuple[dict[str, str], dict]:
    """(every option's value, the `env` table): given ones validated, the rest their defaults."""
    out = {name: (values[0] if values else str(min(os.cpu_count() or 1, 4))) for name, values in OPTIONS.items()}
    out["repack"] = default_repack()
    given = {str(k): v for k, v in options.items()}
    env = given.pop("env", {})
    if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
        raise UsageError("llama.cpp engine: env must be a table of strings,"
                         " e.g. env = { GGML_CPU_DISABLE_FUSION = \"1\" }")
    for k in env:
        if k not in ONCE_ENV:
            raise UsageError(f"llama.cpp engine: env {k!r} is not one ggml reads once per process;"
                             f" choose from {', '.join(ONCE_ENV)} (runtime switches are options: attn_rot,"
                             f" cublas_compute_type)")
    if "kv_type" in given and ({"type_k", "type_v"} & given.keys()):
        raise UsageError("llama.cpp engine: give kv_type or type_k/type_v, not both")
    for name, value in given.items():
        out[name] = _check_value(name, value, gpu=gpu, n_layers=n_layers)
    if "kv_type" in given:
        out["type_k"] = out["type_v"] = out["kv_type"]
    elif {"type_k", "type_v"} & given.keys():
        out["kv_type"] = None  # type_k / type_v rule
    return out, dict(env)


def default_toggles(opts: Mapping[str, str | None], gpu: bool, n_layers: int) -> tuple[Toggle, ...]:
    names = ["n_ubatch", "flash_attn"]
    names += ["kv_type"] if opts["kv_type"] is not None else ["type_k", "type_v"]
    names += ["n_threads"] + (["n_gpu_layers", "op_offload"] if gpu else [])
    out = []
    for name in names:
        first = opts[name]
        if name == "n_threads":
            rest = ["1", "2", *(str(n) for n in (4, 8) if n <= (os.cpu_count() or 1))]
        elif name == "n_gpu_layers":
            rest = ["0", str(max(n_layers // 2, 1)), "all"]
        else:
            rest = list(OPTIONS[name])
        values = tuple(dict.fromkeys([first, *rest]))
        out.append(Toggle(name, values, EXACT.get(name) if EXACT.get(name) in values else None,
                          OWNS.get(name, ()), HELP[name], key=name))
    return tuple(out)


def check_toggles(toggles: tuple[Toggle, ...], gpu: bool, n_layers: int) -> tuple[Toggle, ...]:
    seen = check_toggle_keys("llama.cpp", toggles, lambda key, v: _check_value(key, v, where="toggle key",
                                                                                gpu=gpu, n_layers=n_layers))
    if "kv_type" in seen and ({"type_k", "type_v"} & seen):
        raise UsageError("llama.cpp engine: toggles set kv_type and type_k/type_v; keep one of them")
    return toggles


def make_llamacpp_engine(spec: EngineSpec, model=None, kv: str = "q8", deep: bool = False,
                         load: bool = True) -> "LlamaCppEngine":
    """load=False: checks and toggles only (the app's side of an engine whose runs go to a child process)."""
    llama_cpp = _llama()
    from .ggml_tensor import load_ggml

    ggml = load_ggml()
    problem = ggml.layout_problem()
    if problem:
        raise UsageError(f"llama.cpp engine: llama-cpp-python {llama_cpp.__version__}'s ggml does not match"
                         f" this reader ({problem}); use llama-cpp-python 0.3.36")
    if kv not in ("q8", "f32"):
        raise UsageError(f"llama.cpp engine: kv {kv!r}: choose from q8, f32")
    path = _check_path(spec.model)
    if model is None and path is not None:
        from ..model.hf import load_model

        model = load_model(path, "q4_0" if _is_q4(path) else "f32")
    if model is None:
        raise UsageError("llama.cpp engine: no model; give a .gguf file (kestrel-tui export writes one)")
    gpu, n = _gpu(llama_cpp), model.cfg.n_layers
    opts, env = parse_options(spec.options, gpu, n)
    toggles = check_toggles(tuple(spec.toggles), gpu, n) if spec.toggles is not None else \
        default_toggles(opts, gpu, n)
    return LlamaCppEngine(llama_cpp, ggml, path, model, opts, env, toggles, kv=kv, deep=deep, load=load)


def _check_path(path) -> str | None:
    if path is None or str(path) == "default":
        return None
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"llama.cpp engine: {path} is a folder; it takes a .gguf file (an HF folder"
                         f" converts with kestrel-tui export --model {path} --out FILE.gguf)")
    if not p.exists():
        raise UsageError(f"llama.cpp engine: {path}: no such file; it takes a .gguf file"
                         f" (kestrel-tui export writes one)")
    if not p.is_file():
        raise UsageError(f"llama.cpp engine: {path} is not a regular file (a device or a pipe); it takes"
                         f" a .gguf file")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UsageError(f"llama.cpp engine: {path} is not a GGUF file (no GGUF magic); convert the"
                             f" model with kestrel-tui export or llama.cpp's convert_hf_to_gguf.py")
    return str(p)


def _is_q4(path: str) -> bool:
    """Whether the file holds q4_0 tensors (then they are used as they are), read by our bounded
    header reader: a damaged count costs a line later, in the loader, not memory here."""
    from ..model.gguf import tensor_types

    try:
        return 2 in tensor_types(path)  # GGML type 2: Q4_0
    except (UsageError, OSError):
        return False  # the loader names what is wrong with the file


class LlamaCppEngine(Engine):
    name = "llama.cpp"

    def __init__(self, llama_cpp, ggml, path: str | None, model, options, env, toggles, kv="q8", deep=False,
                 load: bool = True):
        self.L, self.ggml, self.ours = llama_cpp, ggml, model
        self.options, self.env, self.toggles, self.kv, self.deep = dict(options), dict(env), toggles, kv, deep
        self.fields = frozenset(("emb", "logits", *FIELDS, *(DEEP_FIELDS if deep else ())))
        # prefill_from: llama.cpp's KV cache takes no rows from outside (llama_state_seq_set_data wants its own
        # serialized format); isolate: ggml computes the graph, no node's input can be replaced from Python
        self.caps = Capabilities(prefill_from=False, forcing=True, isolate=False, logits=True, raw=True)
        self._tmp = None
        self.path = path or self._export()
        self._model = None   # (n_gpu_layers, llama_model*)
        self._ctx = None     # (context key, llama_context*)
        self._cap: _Capture | None = None
        self._cancel = None
        self._depth = 0
        self._log: collections.deque[str] = collections.deque(maxlen=8)  # warnings and errors, the latest
        self._error: str | None = None  # the first error since the log was cleared: the cause, not its echoes
        self._kept_last = False         # the previous message was kept (a CONT part belongs to it)
        # ctypes callbacks live as long as the engine: llama.cpp keeps the raw pointers
        self._cb_eval = llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)
        self._cb_abort = llama_cpp.ggml_abort_callback(lambda _: bool(self._cancel and self._cancel.is_set()))
        self._cb_log = llama_cpp.llama_log_callback(self._on_log)
        if load:
            with self._quiet():  # load now: a file llama.cpp refuses is an error when the engine is built
                self._load(self.settings({}))

    @property
    def device_name(self) -> str:
        return f"llama.cpp (llama-cpp-python {self.L.__version__}, {'GPU build' if _gpu(self.L) else 'CPU'})"

    def _export(self) -> str:
        from ..model.gguf import write_gguf

        # the embedded default as a GGUF, so a profile without a model runs as shipped (both sides: same weights)
        # the owner's pid in the name: a folder a killed tool left is swept at the next start (procs.py)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"kestrel-llama-{os.getpid()}-")
        procs.add_folder(self._tmp.name)
        path = str(Path(self._tmp.name) / "model.gguf")
        write_gguf(self.ours, path)
        return path

    # -- llama.cpp objects
    def _on_log(self, level, text, _):
        if not text:
            return
        part = text.decode("utf-8", "replace")
        if level == LOG_CONT:
            if self._kept_last and self._log:
                if self._error is not None and self._error is self._log[-1]:
                    self._error += part
                    self._log[-1] = self._error
                else:
                    self._log[-1] += part
            return
        self._kept_last = level in (LOG_WARN, LOG_ERROR)  # kept for the one-line message of a failure
        if self._kept_last:
            self._log.append(part)
            if level == LOG_ERROR and self._error is None:
                self._error = part

    def _clear_log(self, *lines: str) -> None:
        self._log = collections.deque(lines, maxlen=8)
        self._error, self._kept_last = None, False

    @contextlib.contextmanager
    def _quiet(self):
        """llama.cpp logs to stderr, the TUI's terminal: ours while it runs, llama-cpp-python's after."""
        self._depth += 1
        if self._depth == 1:
            self.L.llama_log_set(self._cb_log, ctypes.c_void_p(0))
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                from llama_cpp import _logger

                self.L.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))

    def _why(self) -> str:
        """llama.cpp's own words: its first error (the cause; later ones repeat that it failed), else
        its latest warning."""
        text = self._error if self._error is not None else self._log[-1] if self._log else None
        return f" ({inert(' '.join(text.split()))})" if text and text.strip() else ""

    def settings(self, values: Mapping[str, str]) -> dict[str, str]:
        out = dict(self.options)
        for t in self.toggles:
            key = t.key or t.name
            out[key] = _check_value(key, values.get(t.name, t.default), "toggle key", _gpu(self.L),
                                    self.ours.cfg.n_layers)
        keys = {t.key or t.name for t in self.toggles}
        # kv_type stands for both types unless type_k / type_v rule (given as options, or toggled)
        if "kv_type" in keys or (out["kv_type"] is not None and not {"type_k", "type_v"} & keys):
            out["type_k"] = out["type_v"] = out["kv_type"]
        return out

    def _load(self, s: Mapping[str, str]):
        key = (s["n_gpu_layers"], s["repack"])
        if self._model is not None and self._model[0] == key:
            return self._model[1]
        self._drop()
        self._fix_env()
        L = self.L
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = -1 if key[0] == "all" else int(key[0])
        mp.use_extra_bufts = key[1] == "on"
        self._clear_log()
        with self._quiet():
            L.llama_backend_init()
            m = L.llama_model_load_from_file(self.path.encode(), mp)
        if not m:
            raise UsageError(f"llama.cpp engine: llama.cpp cannot load {self.path}{self._why()}")
        n_file, hidden = L.llama_model_n_layer(m), L.llama_model_n_embd(m)
        cfg = self.ours.cfg
        if n_file != cfg.n_layers or hidden != cfg.hidden:
            L.llama_model_free(m)
            raise UsageError(f"llama.cpp engine: {self.path} has {n_file} layers of {hidden}, the reference's model"
                             f" {cfg.n_layers} of {cfg.hidden}; llama.cpp runs the whole file: give both sides the"
                             f" same GGUF (export the truncated model with kestrel-tui export)")
        self._model = (key, m)
        return m

    def _fix_env(self):
        """The once-read ggml variables: set before the first load here; later loads must agree."""
        global _ENV_AT_START
        if _ENV_AT_START is None:
            for k, v in self.env.items():
                os.environ[k] = v
            _ENV_AT_START = {k: os.environ.get(k) for k in ONCE_ENV}
            return
        for k, v in self.env.items():
            if _ENV_AT_START.get(k) != v:
                raise UsageError(f"llama.cpp engine: env {k}={v!r}, but ggml read it once already in this process"
                                 f" ({_ENV_AT_START.get(k)!r}); give both llama.cpp sides the same env, or run"
                                 f" one as a process engine")

    def _context(self, s: Mapping[str, str], n_ctx: int, n_prompt: int):
        L = self.L
        model = self._load(s)
        ub = n_prompt if s["n_ubatch"] == "prompt" else min(int(s["n_ubatch"]), n_ctx)
        n_ctx = max(256, -(-n_ctx // 256) * 256)
        key = (n_ctx, ub, s["flash_attn"], s["type_k"], s["type_v"], s["op_offload"], s["attn_rot"])
        if self._ctx is not None and self._ctx[0] == key:
            return self._ctx[1], ub
        self._drop_ctx()
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_ctx, max(ub, 1), 1
        cp.n_outputs_max = cp.n_outputs_max_per_seq = n_ctx  # logits of every position (no row pruning)
        cp.n_threads = cp.n_threads_batch = int(s["n_threads"])
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if s["flash_attn"] == "on" else \
            L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k, cp.type_v = KV_TYPES[s["type_k"]], KV_TYPES[s["type_v"]]
        cp.op_offload = s["op_offload"] == "on"
        cp.no_perf = True
        cp.cb_eval, cp.cb_eval_user_data = self._cb_eval, None
        cp.abort_callback, cp.abort_callback_data = self._cb_abort, None
        self._clear_log()
        with self._quiet(), _env("LLAMA_ATTN_ROT_DISABLE", "1" if s["attn_rot"] == "off" else None):
            try:
                ctx = L.llama_init_from_model(model, cp)
            except Exception as e:  # some builds raise instead of returning NULL
                ctx = None
                self._clear_log(_line(e))
        if not ctx:
            raise UsageError(f"llama.cpp engine: llama.cpp refuses a context for {self.path} with"
                             f" {', '.join(f'{k}={s[k]}' for k in ('n_ubatch', 'flash_attn', 'type_k', 'type_v'))}"
                             f"{self._why()}")
        self._ctx = (key, ctx)
        return ctx, ub

    def _drop_ctx(self):
        if self._ctx is not None:
            self.L.llama_free(self._ctx[1])
            self._ctx = None

    def _drop(self):
        self._drop_ctx()
        if self._model is not None:
            self.L.llama_model_free(self._model[1])
            self._model = None

    def close(self) -> None:
        with self._quiet():
            self._drop()
        if self._tmp is not None:
            self._tmp.cleanup()
            procs.remove_folder(self._tmp.name)
            self._tmp = None

    # -- the eval callback
    def _on_tensor(self, ptr, ask, _):
        cap = self._cap
        if cap is None:
            return not ask  # not a run of ours (llama.cpp computes nothing outside llama_decode anyway)
        try:
            return cap.on_tensor(ptr, ask)
        except BaseException as e:  # nothing may cross the C boundary: kept, raised after llama_decode
            cap.error = e
            return False

    # -- a run
    def run(self, req: RunRequest):
        with self._quiet():
            return self._run(req)

    def _run(self, req: RunRequest):
        s = self.settings(req.values)
        P, N = len(req.prompt), req.n_tokens
        schedule = parse_schedule(s["schedule"])
        widest = max(m for _, m in schedule.groups(P, N))  # n_ubatch "prompt": the widest pass in one ubatch
        ctx, _ = self._context(s, P + N + 1, widest)
        L = self.L
        L.llama_set_n_threads(ctx, int(s["n_threads"]), int(s["n_threads"]))
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model[1]))
        trace = Trace(backend=self.describe(req.values), prompt=list(req.prompt), store=RawStore())
        cap = self._cap = _Capture(self.ggml)
        self._cancel = req.cancel
        batch = L.llama_batch_init(max(widest, 1), 0, 1)

        def step(tokens: list[int], pos0: int) -> StepOut:
            for i, tok in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos0 + i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(tokens)
            cap.begin(pos0)
            self._clear_log()
            with _env("GGML_CUDA_CUBLAS_COMPUTE_TYPE",
                      None if s["cublas_compute_type"] == "auto" else s["cublas_compute_type"]):
                rc = L.llama_decode(ctx, batch)
            if req.cancel is not None and req.cancel.is_set():  # the abort callback stopped llama_decode
                raise Cancelled()
            if cap.error is not None:
                raise EngineFailed(f"llama.cpp engine: reading a tensor at position {pos0} failed:"
                                   f" {type(cap.error).__name__}: {_line(cap.error)}", partial=trace)
            if rc != 0:
                raise EngineFailed(f"llama.cpp engine: llama_decode returned {rc} at position {pos0}{self._why()}",
                                   partial=trace)
            logits = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (vocab,)).copy()
                      for i in range(len(tokens))]
            raws = [self._keys(cap, pos0 + i, a) for i, a in enumerate(logits)]
            return StepOut(logits=np.stack(logits), hashes=[{k: fnv1a64(a) for k, a in raw.items()} for raw in raws],
                           raw=raws)

        try:
            return decode_loop(req, trace, step, schedule=schedule,
                               restart=lambda: L.llama_memory_clear(L.llama_get_memory(ctx), True))
        finally:
            L.llama_batch_free(batch)
            self._cap = self._cancel = None

    def _keys(self, cap: "_Capture", t: int, logits: np.ndarray) -> dict[str, np.ndarray]:
        """Position t's keys in the reference's layouts and dtypes."""
        from ..backends.ops_exact import kvquant

        cfg = self.ours.cfg
        got = cap.cols.pop(t, {})
        need = [("emb", None), *((f, li) for li in range(cfg.n_layers) for f in _CAPTURED)]
        missing = [f"{f}-{li}" if li is not None else f for f, li in need if (f, li) not in got
                   and not (f in ("router", "topk", "topw") and not cfg.layer_is_moe(li))]
        if missing:
            raise EngineFailed(f"llama.cpp engine: no graph node for {', '.join(missing[:4])} at position {t}"
                               f" (a llama.cpp whose node names changed?)")
        out = {f"t{t}_emb": got["emb", None].reshape(cfg.hidden)}
        ones = np.ones(cfg.n_kv_heads, np.float32)
        for li in range(cfg.n_layers):
            a = {f: got.get((f, li)) for f in _CAPTURED}
            kpre = a["kpre"].reshape(cfg.n_kv_heads, cfg.head_dim)
            v = a["v"].reshape(cfg.n_kv_heads, cfg.head_dim)
            k, ks, v, vs = (*kvquant(kpre), *kvquant(v)) if self.kv == "q8" else (kpre, ones, v, ones)
            moe = cfg.layer_is_moe(li)
            vals = dict(nrm=a["nrm"].reshape(-1), kraw=a["kraw"].reshape(-1),
                        knorm=a["knorm"].reshape(cfg.n_kv_heads, cfg.head_dim), kpre=kpre, k=k, ks=ks, v=v, vs=vs,
                        qrope=a["qrope"].reshape(cfg.n_heads, cfg.head_dim), attn=a["attn"].reshape(-1),
                        ores=a["ores"].reshape(-1), pnrm=a["pnrm"].reshape(-1),
                        router=a["router"].reshape(-1) if moe else np.zeros(0, np.float32),
                        topk=a["topk"].reshape(-1).astype(np.int32) if moe else np.zeros(0, np.int32),
                        topw=a["topw"].reshape(-1) if moe else np.zeros(0, np.float32),
                        moe=a["moe"].reshape(-1), x=a["x"].reshape(-1))
            for f in layer_fields(self.deep):
                out[f"t{t}_l{li}_{f}"] = np.ascontiguousarray(vals[f])
        out[f"t{t}_logits"] = logits
        return out


# every field read from the graph, after emb (the "embd" node); logits come from the public API
_CAPTURED = ("nrm", "kraw", "knorm", "kpre", "v", "qrope", "attn", "ores", "pnrm", "router", "topk", "topw",
             "moe", "x")
KV_MADE = {"k": "kpre", "ks": "kpre", "vs": "v"}  # kvquant of the row under q8; kpre itself and ones under f32


def _field(base: str, op: str) -> str | None:
    """A node's key field; the same name is given to several nodes (docs/engines-llamacpp.md)."""
    if base == "Kcur":  # mul_mat, reshape (the last one before the norm wins), then rope
        return "kpre" if op == "ROPE" else "kraw"
    if base == "Vcur":  # mul_mat, then reshape: the same values
        return "v"
    if base == "Qcur":
        return "qrope" if op == "ROPE" else None
    return NODES.get(base)


class _Capture:
    """One run's tensors, per position: ``cols[t][(field, layer)]`` = that column's values."""

    def __init__(self, ggml):
        self.ggml = ggml
        self.cols: dict[int, dict] = {}
        self.error: BaseException | None = None
        self._pos = self._m = 0
        self._names: dict[tuple[str, int], tuple | None] = {}

    def begin(self, pos0: int):
        self._pos, self._m = pos0, 0  # the next "embd" node opens the first ubatch at pos0

    def _match(self, name: str, op: int):
        hit = self._names.get((name, op), False)
        if hit is False:
            base, _, tail = name.rpartition("-")
            if base and tail.isdigit():
                f = _field(base, self.ggml.op(op))
                hit = (f, int(tail)) if f is not None else None
            else:
                hit = ("emb", None) if name == "embd" else None
            self._names[name, op] = hit
        return hit

    def on_tensor(self, ptr: int, ask: bool) -> bool:
        from .ggml_tensor import header, read, tensor_name

        t = header(ptr)
        hit = self._match(tensor_name(t), t.op)
        if ask:
            return hit is not None
        if hit is None:
            return True
        a = read(self.ggml, ptr, t)
        if a is None:
            return True
        if hit[0] == "emb":  # each ubatch's graph starts with its embedding rows: the next M positions
            self._pos += self._m
            self._m = int(t.ne[1])
        M = self._m
        if M == 0 or a.size % M:
            raise ValueError(f"{tensor_name(t)} {list(t.ne)} does not split into {M} positions")
        rows = a.reshape(M, -1)
        for m in range(M):
            self.cols.setdefault(self._pos + m, {})[hit] = rows[m]
        return True


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """An environment variable llama.cpp reads at that moment, set for the call and restored after."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return inert(text[0], 200) if text else type(e).__name__
