"""One prompt decoded inside a batch of other prompts, on transformers' own Qwen3 (vLLM's needle test).

The hf engine decodes one sequence. Batch invariance asks whether that sequence's numbers change when
other requests share its forward: here the target prompt is one row of a left-padded batch (an
attention mask over the padding, position ids counted from each row's first real token), every row
decoding one token a step, the target's row read through the same hooks as the hf engine's and
mapped to the same keys. With no other prompts the batch is the target alone, through this same
code: the alone run the batch runs are compared against.

The padding goes on the left so that every row's next token sits in the last column. The target's
keys are its row and its own columns (the padded ones dropped); its K/V rows are the cache's last
columns, as for one sequence. A prefill in one forward (the engine's `prefill=batched`): a batch
cannot take one row's prompt token by token while the others wait.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import UsageError
from ..trace.rawstore import RawStore
from ..trace.run import Cancelled, Position, Trace
from .base import EngineFailed
from .hf import HFEngine, _line, _quiet, _torch_flags
from .hf_hooks import Capture, StepOut, _batch, _flat, _heads, _new_rows, _same, attention_name

PAD_ID = 0  # what the padded columns hold: masked out, so any id does


def target_row(n_others: int) -> int:
    """Where the target sits among n_others + 1 rows: the middle, with neighbours on both sides from 2 on."""
    return n_others // 2


def other_prompts(vocab: int, length: int, n: int, seed: int = 1) -> list[list[int]]:
    """n prompts unlike the target: fixed ids (no randomness between runs), lengths around the target's
    (one shorter, one longer, one as long, in turn), so that the target is padded in some batches."""
    out = []
    for i in range(n):
        size = max(1, length + (-1, 2, 0)[i % 3])
        out.append([(seed + 104729 * (i + 1) + 7907 * j) % vocab for j in range(size)])
    return out


def _columns(t, view, row: int, pad: int, rows: int, cols: int):
    """The target's part of a tensor the hooks kept, laid out as a batch of one (the views then apply)."""
    if view is _batch or view is _flat:   # [B, M, ...]
        return t[row:row + 1, pad:]
    if view is _heads:                    # Q [B, H, M, hd]
        return t[row:row + 1, :, pad:]
    if view is _new_rows:                 # the cache's K/V [B, n_kv, T, hd]: the target's new rows are the last
        return t[row:row + 1]
    if view is _same:                     # the router's [B*M, ...]
        return t.reshape(rows, cols, *t.shape[1:])[row, pad:]
    raise ValueError(f"no batch layout for the view {getattr(view, '__name__', view)!r}")


class RowCapture(Capture):
    """The hf hooks on a batched forward: one row's columns kept, in the keys of a single sequence."""

    def batch_step(self, ids, mask, positions, row: int, pad: int, pos0: int, cache, raw: bool = True) -> StepOut:
        import torch

        self.bufs = {}
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_kw: cache})
        self.bufs["logits", None] = (out.logits, _batch)
        rows, cols = ids.shape
        self.bufs = {k: (_columns(t, view, row, pad, rows, cols), view) for k, (t, view) in self.bufs.items()
                     if not k[0].startswith("_")}
        step = self._collect(pos0, cols - pad, raw)
        self.next_tokens = out.logits[:, -1].argmax(-1).tolist()  # every row's greedy next token
        return step


class BatchRunner:
    """The hf engine's checkpoint and settings, loaded once more for batched runs (the engine's own model
    keeps its own hooks, untouched)."""

    def __init__(self, engine: HFEngine, values: Mapping[str, str]):
        import torch
        from transformers import AutoModelForCausalLM

        self.engine, self.values = engine, dict(values)
        self.settings = s = engine.settings(values)
        try:
            with _quiet():
                m = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=getattr(torch, s["dtype"]),
                                                         attn_implementation=s["attn_implementation"],
                                                         num_hidden_layers=engine.n_layers)
        except Exception as e:  # transformers raises many kinds for a directory it cannot take
            raise UsageError(f"hf engine: transformers cannot load {engine.model_dir}: {_line(e)}") from None
        m = m.to(s["device"]).eval()
        m.set_attn_implementation(attention_name(m, s["attn_implementation"]))
        self.model, self.capture = m, RowCapture(m, engine.kv, engine.deep)

    def close(self) -> None:
        self.capture.remove()

    def run(self, prompt: Sequence[int], n_tokens: int, others: Sequence[Sequence[int]] = (),
            forced: Sequence[int] | None = None, raw: bool = True,
            cancel: threading.Event | None = None) -> Trace:
        """The target's trace, decoded in a batch with ``others`` (each row greedy; the target takes
        ``forced`` after its prompt when given)."""
        import torch
        from transformers import DynamicCache

        if not prompt or any(not o for o in others):
            raise UsageError("hf batch: every prompt needs at least one token")
        row = target_row(len(others))
        prompts = [list(p) for p in others]
        prompts.insert(row, list(prompt))
        longest = max(len(p) for p in prompts)
        pads = [longest - len(p) for p in prompts]
        device = next(self.model.parameters()).device
        ids = torch.tensor([[PAD_ID] * n + p for n, p in zip(pads, prompts)], device=device)
        mask = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(pads, prompts)], device=device)
        # HF's own convention for the padded columns (generate: cumsum - 1, padding at 1): masked either way
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        store = RawStore()
        P = len(prompt)
        alone = "alone" if not others else f"row {row} of {len(prompts)}"
        trace = Trace(backend=f"{self.engine.describe(self.values)}, {alone}", prompt=list(prompt), store=store)

        def record(out: StepOut, pos0: int, tokens: list[int]):
            for j, tok in enumerate(tokens):
                trace.positions.append(Position(t=pos0 + j, token=tok, prompt=pos0 + j < P, hashes=out.hashes[j],
                                                raw=store.keep(out.raw[j]) if out.raw else None,
                                                logits=np.ascontiguousarray(out.logits[j])))

        cap = self.capture

        def step(ids, mask, positions, pad: int, pos0: int) -> StepOut:
            try:
                return cap.batch_step(ids, mask, positions, row, pad, pos0, cache, raw)
            except (UsageError, KeyboardInterrupt):
                raise
            except Exception as e:  # a torch / transformers failure mid-run: the positions so far stand
                raise EngineFailed(f"hf batch failed at position {pos0}: {type(e).__name__}: {_line(e)}",
                                   partial=trace) from e

        with _torch_flags(self.settings), _quiet():
            cap.begin()
            try:
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                cache = DynamicCache(config=self.model.config)
                record(step(ids, mask, positions, pads[row], 0), 0, list(prompt))
                for i in range(n_tokens):
                    if cancel is not None and cancel.is_set():
                        raise Cancelled()
                    step_ids = list(cap.next_tokens)
                    if forced is not None:
                        step_ids[row] = forced[i]
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                    positions = positions[:, -1:] + 1
                    record(step(torch.tensor([step_ids], device=device).T, mask, positions, 0, P + i), P + i,
                           [step_ids[row]])
            finally:
                cap.end()
        return trace
