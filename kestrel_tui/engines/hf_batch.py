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

from ..errors import UsageError
from ..trace.rawstore import RawStore
from ..trace.run import Trace
from .base import EngineFailed, RunRequest
from .decode import decode_loop
from .hf import HFEngine
from .hf_hooks import Capture
from .hf_torch import first_line, quiet, torch_flags

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


class BatchRunner:
    """The hf engine's checkpoint and settings, loaded once more for batched runs (the engine's own model
    keeps its own hooks, untouched)."""

    def __init__(self, engine: HFEngine, values: Mapping[str, str]):
        self.engine, self.values = engine, dict(values)
        self.settings = engine.settings(values)
        self.model = engine.load_torch_model(self.settings)
        self.capture = Capture(self.model, engine.kv, engine.deep)

    def close(self) -> None:
        self.capture.remove()

    def run(self, prompt: Sequence[int], n_tokens: int, others: Sequence[Sequence[int]] = (),
            forced: Sequence[int] | None = None, raw: bool = True,
            cancel: threading.Event | None = None) -> Trace:
        """The target's trace, decoded in a batch with ``others`` (each row greedy; the target takes
        ``forced`` after its prompt when given, else its own top-1, which is its row's greedy token)."""
        import torch
        from transformers import DynamicCache

        if not prompt or any(not o for o in others):
            raise UsageError("hf batch: every prompt needs at least one token")
        req = RunRequest(list(prompt), n_tokens, self.values, forced=None if forced is None else list(forced),
                         raw=raw, cancel=cancel)
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
        alone = "alone" if not others else f"row {row} of {len(prompts)}"
        trace = Trace(backend=f"{self.engine.describe(self.values)}, {alone}", prompt=list(prompt),
                      store=RawStore())
        cap = self.capture

        def step(tokens: list[int], pos0: int):
            nonlocal mask, positions
            if pos0 == 0:  # the prompts, one forward
                batch, pad = ids, pads[row]
            else:  # the target's token beside every other row's greedy one
                step_ids = list(cap.next_tokens)
                step_ids[row] = tokens[0]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                positions = positions[:, -1:] + 1
                batch, pad = torch.tensor([step_ids], device=device).T, 0
            try:
                return cap.batch_step(batch, mask, positions, row, pad, pos0, cache, raw)
            except (UsageError, KeyboardInterrupt):
                raise
            except Exception as e:  # a torch / transformers failure mid-run: the positions so far stand
                raise EngineFailed(f"hf batch failed at position {pos0}: {type(e).__name__}: {first_line(e)}",
                                   partial=trace) from e

        with torch_flags(self.settings), quiet():
            cap.begin()
            try:
                cache = DynamicCache(config=self.model.config)
                return decode_loop(req, trace, step)
            finally:
                cap.end()
