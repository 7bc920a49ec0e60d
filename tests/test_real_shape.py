"""A Qwen3-0.6B-shaped checkpoint made and saved by transformers itself (vocab 151936, hidden
1024, head_dim 128, tied, bf16, 1 layer) through every headless command and the app's first
screen, in q4_0 and f32; with f32 weights and KV the greedy tokens are transformers' own."""
from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kestrel_tui.app.app import KestrelApp  # noqa: E402
from kestrel_tui.app.source import LiveSource, config_loader  # noqa: E402
from kestrel_tui.session.inputs import run_config  # noqa: E402

from clitools import run_cli as run  # noqa: E402
from hfmodels import qwen3_06b_shaped  # noqa: E402

PROMPT = [1, 2, 3, 151935, 100000]
N_TOKENS = 3


@pytest.fixture(scope="module")
def qwen3_06b_dir(tmp_path_factory):
    return qwen3_06b_shaped(tmp_path_factory.mktemp("qwen3-0.6b-shaped"))


def hf_greedy(folder) -> list[int]:
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=N_TOKENS, do_sample=False)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("weights", ["q4_0", "f32"])
def test_headless_commands(qwen3_06b_dir, tmp_path, capsys, weights):
    common = ["--model", qwen3_06b_dir, "--weights", weights, "--prompt-ids", ",".join(map(str, PROMPT)),
              "--tokens", N_TOKENS]
    code, out, err = run(capsys, "generate", *common, "--kv", "f32")
    assert code == 0 and err == "", err
    ids = [int(t) for t in out.split()]
    assert len(ids) == N_TOKENS and all(0 <= i < 151936 for i in ids)
    if weights == "f32":
        assert ids == hf_greedy(qwen3_06b_dir)
    dump = tmp_path / f"{weights}.txt"
    code, out, err = run(capsys, "dump", *common, "--out", dump)
    assert code == 0 and len(dump.read_text().splitlines()) == (len(PROMPT) + N_TOKENS) * 13
    code, out, err = run(capsys, "run", *common, "--subject", "sim", "--exact", "all")
    assert code == 0 and "all ok" in out, out + err


@pytest.mark.anyio
@pytest.mark.parametrize("weights", ["q4_0", "f32"])
async def test_app_first_screen(qwen3_06b_dir, tmp_path, weights):
    config = run_config(model=str(qwen3_06b_dir), prompt_ids=",".join(map(str, PROMPT)), tokens=N_TOKENS,
                        weights=weights, subject="sim")
    app = KestrelApp(LiveSource(config_loader(config)), export_dir=tmp_path / "exports")
    async with app.run_test(size=(120, 40)) as pilot:
        main_screen = app.main
        for _ in range(600):
            await app.workers.wait_for_complete()
            await pilot.pause()
            if main_screen.result is not None and main_screen.phase == "idle":
                break
        assert main_screen.phase == "idle", main_screen.status.text
        assert main_screen.session.model.cfg.vocab == 151936
        assert main_screen.board.n_positions == len(PROMPT) + N_TOKENS and main_screen.board.n_layers == 1
        assert main_screen.result.first_diff is not None  # all fast: the sim differs somewhere
