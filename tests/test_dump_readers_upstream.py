"""SGLang's own dumper code on the fixture model: its legacy TensorDumper
(python/sglang/srt/debug_utils/tensor_dump_forward_hook.py) and its dumper (dumper.py, non-intrusive mode
"all" plus an explicit partial-sum dump), run for real on CPU at TP=1 and TP=2 over gloo, must write what
tests/dumpfixtures.py's writers write (the same records, the same bits), and the reader must read the
same keys from both.

SGLang does not install here (its wheel pulls a CUDA torch), so these tests need its source: set
KESTREL_TEST_SGLANG_SOURCE to a folder holding sglang/srt/debug_utils/ (an unpacked sglang wheel, e.g.
`pip download --no-deps sglang` and unzip). The two files import a few SGLang modules for their types
and parallel state; small stand-ins for those are put in sys.modules (what each stands for is named
below). Without the variable the tests are skipped, and so are not counted as run."""
from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dumpfixtures as fx  # noqa: E402
from kestrel_tui.engines.dumps import read_folder  # noqa: E402

SOURCE = os.environ.get("KESTREL_TEST_SGLANG_SOURCE")
pytestmark = pytest.mark.skipif(not SOURCE, reason="KESTREL_TEST_SGLANG_SOURCE names no SGLang source")
PROMPT, N = [5, 77, 19, 33], 3


class _PPProxyTensors:  # forward_batch_info.PPProxyTensors: pipeline hand-offs, none here
    tensors: dict = {}


def _parallel():
    """runtime_context.get_parallel(): the ranks of this process (TP over the whole world, no PP/EP/DP)."""
    import torch.distributed as dist

    r, n = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return types.SimpleNamespace(tp_rank=r, tp_size=n, pp_rank=0, pp_size=1, moe_ep_rank=0, moe_ep_size=1,
                                 moe_tp_rank=r, moe_tp_size=n, moe_dp_rank=0, attn_tp_rank=r, attn_tp_size=n,
                                 attn_dp_rank=0, attn_dp_size=1, attn_cp_rank=0, attn_cp_size=1)


def load_upstream(src: str):
    """SGLang's tensor_dump_forward_hook and dumper modules, loaded from ``src`` with stand-ins for the
    SGLang modules they import."""
    stubs = {
        "zmq": {},  # the dumper's HTTP control channel: off (no server port)
        "sglang": {}, "sglang.srt": {}, "sglang.srt.layers": {}, "sglang.srt.managers": {},
        "sglang.srt.model_executor": {}, "sglang.srt.debug_utils": {},
        "sglang.srt.layers.logits_processor": {"LogitsProcessorOutput": fx.LogitsOutput},
        "sglang.srt.model_executor.forward_batch_info": {"ForwardBatch": fx.Batch, "PPProxyTensors": _PPProxyTensors},
        "sglang.srt.managers.io_struct": {"sock_recv": None, "sock_send": None, "wrap_as_pickle": None},
        "sglang.srt.runtime_context": {"get_parallel": _parallel, "get_server_args": lambda: None,
                                       "get_serving": lambda: None},
        "sglang.srt.utils": {"get_device": lambda: "cpu"},
        "sglang.srt.distributed": {},
        # layer_boundary: SGLang's deferred all-reduce (UnreducedOutput.partial) and residual hand-offs; the
        # fixture model makes neither
        "sglang.srt.layers.layer_boundary": {}, "sglang.srt.layers.layer_boundary.residual": {},
        "sglang.srt.layers.layer_boundary.output": {"UnreducedOutput": type("UnreducedOutput", (), {})},
        "sglang.srt.layers.layer_boundary.residual.stream": {"OwedOutput": type("OwedOutput", (), {})},
        "sglang.srt.layers.dp_attention": {"get_moe_cp_size": lambda: 1, "is_dp_attention_enabled": lambda: False},
    }
    for name, attrs in stubs.items():
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__dict__.update(attrs)
            m.__path__ = []
            sys.modules[name] = m
    out = []
    for mod in ("tensor_dump_forward_hook", "dumper"):
        name = f"sglang.srt.debug_utils.{mod}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, Path(src) / "sglang/srt/debug_utils" / f"{mod}.py")
            m = importlib.util.module_from_spec(spec)
            sys.modules[name] = m
            spec.loader.exec_module(m)
        out.append(sys.modules[name])
    return out


def run_upstream(sd, kind, prompts, n_new, out: Path, hf_from: Path | None = None):
    """This rank's dumps by SGLang's own code: out/legacy (TensorDumper), out/dumper (the dumper); the
    fixture's exact ops, or transformers' model of the checkpoint folder ``hf_from`` (fx.hf_ops)."""
    with fx.hf_ops(hf_from):
        _run_upstream(sd, kind, prompts, n_new, out)


def _run_upstream(sd, kind, prompts, n_new, out: Path):
    legacy, dumper_mod = load_upstream(SOURCE or os.environ["KESTREL_TEST_SGLANG_SOURCE"])
    r, n = fx.tp_info()
    m = fx.ForCausalLM(sd, kind, "sglang", fx.LogitsOutput).eval()
    legacy.register_forward_hook_for_model(m, str(out / "legacy"), None, n, r, 0)
    fx.serve(m, prompts, n_new)
    cfg = dumper_mod.DumperConfig(enable=True, dir=str(out / "dumper"), exp_name="dump_upstream",
                                  enable_output_console=False, non_intrusive_mode="all")
    d = dumper_mod._Dumper(config=cfg)
    m = fx.ForCausalLM(sd, kind, "sglang", fx.LogitsOutput, dumper=d).eval()
    d.register_non_intrusive_dumper(m)
    fx.serve(m, prompts, n_new, on_forward=d.step)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """kind -> {tp: folder}: ours (vllm/, sglang/, dumper/) and SGLang's (legacy/, dumper/ under up/)."""
    root = tmp_path_factory.mktemp("upstream")
    out, jobs = {}, []
    for kind, seed in (("dense", 1), ("moe", 2)):
        sd = fx.write_checkpoint(kind, root / f"ckpt_{kind}", seed)
        out[kind] = {}
        for tp in (1, 2):
            ours, up = root / f"{kind}_tp{tp}_ours", root / f"{kind}_tp{tp}_up"
            out[kind][tp] = (ours, up)
            if tp == 1:
                fx.run_all(sd, kind, [PROMPT], N, ours)
                run_upstream(sd, kind, [PROMPT], N, up)
        fx.run_tp([(sd, kind, [PROMPT], N, out[kind][2][0])])
        jobs.append((sd, kind, [PROMPT], N, out[kind][2][1]))
    fx.run_tp(jobs, target=run_upstream)
    return out


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        return a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))
    return a == b


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sglang_legacy_dumper_writes_what_the_fixture_writes(runs, kind, tp):
    ours, up = runs[kind][tp]
    mine = {p.name.split("_pid")[0]: p for p in (ours / "sglang").iterdir()}
    theirs = {p.name.split("_pid")[0]: p for p in (up / "legacy").iterdir()}
    assert sorted(mine) == sorted(theirs) == [f"TP{r}_PP0_Rank{r}" for r in range(tp)]
    for rank, folder in theirs.items():
        names = sorted(p.name for p in folder.iterdir())
        assert names == sorted(p.name for p in mine[rank].iterdir()) and len(names) == N + 1
        for name in names:
            a, b = torch.load(folder / name, weights_only=True), torch.load(mine[rank] / name, weights_only=True)
            assert sorted(a) == sorted(b), name
            bad = [k for k in a if not _same(a[k], b[k])]
            assert not bad, (name, bad[:3])
    assert read_folder(up / "legacy").hashes() == read_folder(ours / "sglang").hashes()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sglang_dumper_records_hold_what_the_fixture_writes(runs, kind, tp):
    ours, up = runs[kind][tp]
    def records(folder):  # (step, rank, name, layer) -> the records in dump order (a module may run often)
        out = {}
        for p in folder.iterdir():
            rec = torch.load(p, weights_only=True)
            m = rec["meta"]
            out.setdefault((m["step"], m["rank"], m["name"], m.get("layer_id")), []).append((m["dump_index"], rec))
        return {k: [r for _, r in sorted(v, key=lambda x: x[0])] for k, v in out.items()}

    theirs, mine = records(up / "dumper" / "dump_upstream"), records(ours / "dumper" / "dump_fixture")
    n_ours = 0
    for key, recs in mine.items():
        assert key in theirs and len(theirs[key]) == len(recs), key
        for rec, t in zip(recs, theirs[key]):
            assert _same(rec["value"], t["value"]), key
            m, tm = rec["meta"], t["meta"]
            assert tm.get("dims") == m.get("dims") and tm["sglang_parallel_info"]["tp_rank"] == m["rank"], key
            assert tm["sglang_parallel_info"]["tp_size"] == tp
            n_ours += 1
    assert n_ours and len(theirs) > n_ours  # SGLang's also keeps every module's inputs
    a, b = read_folder(up / "dumper"), read_folder(ours / "dumper")
    assert a.hashes() == b.hashes() and a.partial == b.partial
    assert bool(a.partial) == (kind == "moe" and tp == 2)
    k = next(iter(a.hashes()))
    assert np.array_equal(np.asarray(a.raw(k)), np.asarray(b.raw(k)))
