"""Loading progress: the HF and GGUF loaders report tensors and bytes, and the app shows them."""
from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from kestrel_tui.app.app import KestrelApp
from kestrel_tui.app.source import LiveSource, loaded
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import Session
from kestrel_tui.model import progress as progress_mod
from kestrel_tui.model.config import default_config
from kestrel_tui.model.gguf import write_gguf
from kestrel_tui.model.hf import load_model
from kestrel_tui.model.hf_export import hf_config, hf_state_dict
from kestrel_tui.model.progress import LoadStep
from kestrel_tui.model.weights import synthetic_model

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    """The default model's dims, 2 layers, as 3 safetensors shards + index (a loader's whole path)."""
    folder = tmp_path_factory.mktemp("sharded")
    src = synthetic_model(default_config().with_layers(2), "q4_0")
    hf_config(src).to_json_file(str(folder / "config.json"))
    sd = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in hf_state_dict(src).items()}
    names = sorted(sd)
    weight_map = {}
    for i, part in enumerate(np.array_split(np.array(names), 3)):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: sd[n] for n in part}, str(folder / shard))
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder, len(names), sum(v.nbytes for v in sd.values())


def _steps_are_a_progress(steps: list[LoadStep], n_tensors: int, n_bytes: int) -> None:
    assert steps, "no progress was reported"
    assert all(s.tensors_total == n_tensors and s.bytes_total == n_bytes for s in steps)
    done = [(s.tensors_done, s.bytes_read) for s in steps]
    assert done == sorted(done) and done[-1] == (n_tensors, n_bytes)


def test_hf_load_reports_tensors_and_bytes(sharded_dir, monkeypatch):
    folder, n_tensors, n_bytes = sharded_dir
    monkeypatch.setattr(progress_mod, "PERIOD", 0.0)  # every read, not 10 a second
    steps: list[LoadStep] = []
    load_model(folder, "q4_0", progress=steps.append)
    _steps_are_a_progress(steps, n_tensors, n_bytes)
    assert len(steps) > n_tensors  # row chunks of the big matrices report on their own
    assert steps[-1].line() == f"{n_tensors}/{n_tensors} tensors, {n_bytes / 1e9:.2f}/{n_bytes / 1e9:.2f} GB read"


def test_gguf_load_reports_tensors_and_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_mod, "PERIOD", 0.0)
    path = tmp_path / "m.gguf"
    write_gguf(load_model(None, n_layers=2), path)
    steps: list[LoadStep] = []
    load_model(path, "q4_0", progress=steps.append)
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    _steps_are_a_progress(steps, len(tensors), sum(int(t.n_bytes) for t in tensors))


@pytest.mark.anyio
async def test_app_shows_loading_progress(small_model, tmp_path):
    gate = threading.Event()

    def loader(progress):
        progress(LoadStep(3, 10, 2_500_000_000, 5_000_000_000))
        gate.wait(30)
        return loaded(Session(small_model, default_prompt(small_model.cfg.vocab), 2, subject="sim"))

    app = KestrelApp(LiveSource(loader), export_dir=tmp_path / "exports")
    async with app.run_test(size=(120, 40)) as pilot:
        status = app.main.status
        for _ in range(500):
            await pilot.pause()
            if "3/10 tensors" in status.text:
                break
            await asyncio.sleep(0.01)
        assert status.text == "loading the model… 3/10 tensors, 2.50/5.00 GB read"
        bar = status.query_one("#progress")
        assert bar.display and (bar.progress, bar.total) == (2_500_000_000, 5_000_000_000)
        gate.set()
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "tensors" not in status.text  # the run took over the status line
