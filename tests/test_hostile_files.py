"""Tiny hostile files cost little: every count read from a model file is checked against what the file
can hold before anything is allocated or looped over, JSON and TOML nested thousands deep or holding
thousands of digits are refused, and a FIFO or device where a file is expected is refused unread.

Each case runs the real CLI in a child under RLIMIT_AS 3 GB with a hard time limit (the unbounded
versions grew past 6 GB or never ended) and must end with one line, exit 2, within 5 s and 200 MB of
peak RSS. The child reads the package from this test's own checkout, so the same file checks any tree.
"""
from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
AS_LIMIT = 3 << 30
LIMIT_S = 5.0
LIMIT_MB = 200
KILL_S = 20  # the child's hard limit: a hang fails the test here instead of hanging it


# The child's own peak (VmHWM of the program after exec): ru_maxrss would include the pages it
# shared with this test process when it was forked.
_CHILD = """
import atexit, sys
def _hwm(path=sys.argv[1]):
    with open("/proc/self/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(path, "w") as f:
        f.write(kb)
atexit.register(_hwm)
from kestrel_tui.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _cli(*argv, cwd: Path) -> tuple[int | None, str, float, float]:
    """(exit status or None if killed, stderr, seconds, peak RSS in MB) of `kestrel-tui ARGV`."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    err_path = cwd / f".stderr-{time.monotonic_ns()}"
    hwm_path = cwd / f".hwm-{time.monotonic_ns()}"
    code = [sys.executable, "-c", _CHILD, str(hwm_path), *map(str, argv)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(err_path, "wb") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(code, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, preexec_fn=limit, start_new_session=True)
        status = None
        while status is None:
            pid, st, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(st)
                break
            if time.monotonic() - t0 > KILL_S:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, st, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        proc.returncode = -9  # reaped by wait4 above
    text = err_path.read_text(errors="replace")
    err_path.unlink()
    hwm = int(hwm_path.read_text()) if hwm_path.exists() else usage.ru_maxrss
    hwm_path.unlink(missing_ok=True)
    return status, text, elapsed, hwm / 1024


def _refused(argv, cwd: Path, *needles: str) -> str:
    status, err, elapsed, rss = _cli(*argv, cwd=cwd)
    lines = [x for x in err.splitlines() if x.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, \
        f"status {status} after {elapsed:.1f} s, {rss:.0f} MB peak: {err[-1500:]}"
    assert elapsed < LIMIT_S and rss < LIMIT_MB, f"{elapsed:.1f} s, {rss:.0f} MB: {lines[0]}"
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _generate(model) -> list:
    return ["generate", "--model", model, "--prompt-ids", "1,2", "--tokens", "1"]


# ---------------------------------------------------------------- model files

def _tiny_model(moe: bool = False, fmt: str = "q4_0"):
    from kestrel_tui.model.config import Config
    from kestrel_tui.model.weights import synthetic_model

    common = dict(n_layers=2, hidden=32, n_heads=2, n_kv_heads=1, head_dim=16, vocab=64, rope_theta=1e6,
                  eps=1e-6, max_positions=64)
    cfg = Config(arch="qwen3_moe", tie_embeddings=True, n_experts=4, top_k=2, moe_intermediate=32, **common) \
        if moe else Config(arch="qwen3", tie_embeddings=False, intermediate=32, **common)
    return synthetic_model(cfg, fmt, seed=3, name="tiny")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    from kestrel_tui.model.gguf import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(_tiny_model(), path)
    return path.read_bytes()


def test_a_133_byte_gguf_declaring_an_array_of_2_40_bytes(tmp_path):
    key = b"general.architecture"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<IIQ", 9, 0, 2**40)  # an array of u8, 2^40 of them
    data += bytes(133 - len(data))
    assert len(data) == 133
    (tmp_path / "m.gguf").write_bytes(data)
    _refused(_generate("m.gguf"), tmp_path, "m.gguf", "1099511627776", "133 bytes")
    if importlib.util.find_spec("llama_cpp") is not None:  # the llama.cpp engine reads its header too
        (tmp_path / "p.toml").write_text('model = "m.gguf"\n[reference]\nengine = "cpu"\n'
                                         '[subject]\nengine = "llama.cpp"\n')
        _refused(["run", "--profile", "p.toml", "--prompt-ids", "1,2", "--tokens", "1"], tmp_path,
                 "m.gguf", "1099511627776")


def test_a_valid_gguf_with_block_count_patched_to_10_9(tmp_path, tiny_gguf):
    key = b"qwen3.block_count"
    at = tiny_gguf.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", tiny_gguf, at) == (4, 2)  # a u32, 2 blocks
    data = bytearray(tiny_gguf)
    struct.pack_into("<I", data, at + 4, 10**9)
    (tmp_path / "m.gguf").write_bytes(data)
    _refused(_generate("m.gguf"), tmp_path, "m.gguf", "block_count is 1000000000", "2 blocks")


def test_the_valid_gguf_still_loads(tmp_path, tiny_gguf):
    (tmp_path / "m.gguf").write_bytes(tiny_gguf)
    status, err, _, _ = _cli(*_generate("m.gguf"), cwd=tmp_path)
    assert status == 0, err


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


HF_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "vocab_size": 64, "intermediate_size": 32, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
             "rope_theta": 1e6, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def hf_tensors() -> dict[str, np.ndarray]:
    from kestrel_tui.model.hf_export import hf_state_dict

    return hf_state_dict(_tiny_model(fmt="f32"))


def _hf_dir(root: Path, hf_tensors, config_text: str | None = None) -> Path:
    d = root / "hf"
    d.mkdir()
    _write_safetensors(d / "model.safetensors", hf_tensors)
    (d / "config.json").write_text(json.dumps(HF_CONFIG) if config_text is None else config_text)
    return d


def _config_with(key: str, text: str) -> str:
    return json.dumps({**HF_CONFIG, key: "@"}).replace('"@"', text)


def test_the_valid_hf_dir_still_loads(tmp_path, hf_tensors):
    _hf_dir(tmp_path, hf_tensors)
    status, err, _, _ = _cli(*_generate("hf"), cwd=tmp_path)
    assert status == 0, err


def test_a_config_claiming_1e8_layers(tmp_path, hf_tensors):
    _hf_dir(tmp_path, hf_tensors, _config_with("num_hidden_layers", "1e8"))
    _refused(_generate("hf"), tmp_path, "config.json", "num_hidden_layers is 100000000", "2 layers")


def test_a_config_claiming_a_vocabulary_of_1e12(tmp_path, hf_tensors):
    _hf_dir(tmp_path, hf_tensors, _config_with("vocab_size", "1e12"))
    _refused(_generate("hf"), tmp_path, "model.embed_tokens.weight", "1000000000000", "model.safetensors")


def test_a_config_claiming_a_billion_experts(tmp_path, hf_tensors):
    moe = _tiny_model(moe=True, fmt="f32")
    from kestrel_tui.model.hf_export import hf_state_dict

    cfg = {**HF_CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 10**9,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "tie_word_embeddings": True}
    d = tmp_path / "hf"
    d.mkdir()
    _write_safetensors(d / "model.safetensors", hf_state_dict(moe))
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(_generate("hf"), tmp_path, "mlp.gate.weight", "1000000000")


@pytest.mark.parametrize("text, needle", [("[" * 5000 + "]" * 5000, "nested more than"),
                                          ('{"a":' * 5000 + "1" + "}" * 5000, "nested more than"),
                                          ("9" * 5000, "an integer of 5000 digits")],
                         ids=["arrays", "objects", "digits"])
def test_a_config_nested_thousands_deep_or_with_thousands_of_digits(tmp_path, hf_tensors, text, needle):
    _hf_dir(tmp_path, hf_tensors, _config_with("hidden_size", text))
    _refused(_generate("hf"), tmp_path, "config.json", needle)


def test_an_index_nested_thousands_deep(tmp_path, hf_tensors):
    d = _hf_dir(tmp_path, hf_tensors)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 5000 + "]" * 5000 + "}")
    _refused(_generate("hf"), tmp_path, "model.safetensors.index.json", "nested more than")


def test_a_safetensors_header_claiming_2_63_bytes(tmp_path, hf_tensors):
    d = _hf_dir(tmp_path, hf_tensors)
    data = bytearray((d / "model.safetensors").read_bytes())
    struct.pack_into("<Q", data, 0, 2**63)
    (d / "model.safetensors").write_bytes(data)
    _refused(_generate("hf"), tmp_path, "model.safetensors")


# ---------------------------------------------------------------- profiles (TOML)

@pytest.mark.parametrize("text, needle", [
    ("description = " + "[" * 5000 + "]" * 5000 + "\n", ":1: arrays or inline tables nested more than"),
    ("description = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n", ":1: arrays or inline tables nested more than"),
    ("x" + ".x" * 5000 + " = 1\n", "nested more than"),
    ('description = "a"\ntokens = ' + "1" * 5000 + "\n", ":2: an integer of more than"),
], ids=["arrays", "inline-tables", "dotted-keys", "digits"])
def test_a_profile_nested_thousands_deep_or_with_thousands_of_digits(tmp_path, text, needle):
    (tmp_path / "p.toml").write_text(text)
    _refused(["generate", "--profile", "p.toml", "--tokens", "1"], tmp_path, "p.toml", needle)


# ---------------------------------------------------------------- not regular files

def test_profile_dev_zero_is_refused_unread(tmp_path):
    _refused(["generate", "--profile", "/dev/zero", "--tokens", "1"], tmp_path, "/dev/zero", "character device")


def test_a_fifo_profile_is_refused_unread(tmp_path):
    os.mkfifo(tmp_path / "p.toml")
    _refused(["generate", "--profile", "p.toml", "--tokens", "1"], tmp_path, "p.toml", "FIFO")


def test_a_fifo_gguf_is_refused_as_such(tmp_path):
    os.mkfifo(tmp_path / "m.gguf")
    _refused(_generate("m.gguf"), tmp_path, "m.gguf", "FIFO")


def test_a_fifo_config_json_is_refused_unread(tmp_path, hf_tensors):
    d = _hf_dir(tmp_path, hf_tensors)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    _refused(_generate("hf"), tmp_path, "config.json", "FIFO")


def test_a_fifo_safetensors_file_is_refused_unread(tmp_path, hf_tensors):
    d = _hf_dir(tmp_path, hf_tensors)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    _refused(_generate("hf"), tmp_path, "model.safetensors", "FIFO")


@pytest.mark.parametrize("which", ["fifo", "/dev/zero"])
def test_diff_refuses_a_fifo_or_device_unread(tmp_path, which):
    (tmp_path / "good.txt").write_text("t0_emb 0123456789abcdef\n")
    if which == "fifo":
        os.mkfifo(tmp_path / "a.txt")
        a, needle = "a.txt", "FIFO"
    else:
        a, needle = "/dev/zero", "character device"
    _refused(["diff", a, "good.txt"], tmp_path, a, needle)
    _refused(["diff", "good.txt", a], tmp_path, a, needle)


# ---------------------------------------------------------------- the readers themselves

def test_readers_refuse_without_blocking(tmp_path):
    from kestrel_tui.readers import NotRegular, TooLarge, read_regular

    os.mkfifo(tmp_path / "f")
    with pytest.raises(NotRegular, match="FIFO"):
        read_regular(tmp_path / "f", 100)
    with pytest.raises(IsADirectoryError):
        read_regular(tmp_path, 100)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(TooLarge, match="101 bytes"):
        read_regular(tmp_path / "big", 100)
    assert read_regular(tmp_path / "big", 101) == b"x" * 101


def test_parse_json_keeps_real_configs_and_refuses_the_limits():
    from kestrel_tui.readers import LimitError, parse_json

    assert parse_json(json.dumps(HF_CONFIG)) == HF_CONFIG
    assert parse_json("[" * 60 + "]" * 60) is not None
    for text in ("[" * 65 + "]" * 65, "[" * 100000 + "]" * 100000, "1" * 101, "-" + "1" * 101):
        with pytest.raises(LimitError):
            parse_json(text)
    assert parse_json("1" * 100) == int("1" * 100)


# ---------------------------------------------------------------- finite values q4_0 cannot hold

def test_a_gguf_weight_beyond_q4_0s_range_is_refused_by_name(tmp_path):
    import gguf

    from kestrel_tui.model.gguf import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(_tiny_model(fmt="f32"), path)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    data = bytearray(path.read_bytes())
    struct.pack_into("<f", data, int(t.data_offset), 1e30)  # finite in f32; its q4_0 scale is not in f16
    path.write_bytes(data)
    _refused(_generate("m.gguf") + ["--weights", "q4_0"], tmp_path, "m.gguf", "blk.0.attn_q.weight", "--weights f32")


def test_an_hf_weight_beyond_q4_0s_range_is_refused_by_name(tmp_path, hf_tensors):
    tensors = dict(hf_tensors)
    w = tensors["model.layers.1.self_attn.k_proj.weight"].copy()
    w[0, 0] = 1e30
    tensors["model.layers.1.self_attn.k_proj.weight"] = w
    _hf_dir(tmp_path, tensors)
    _refused(_generate("hf"), tmp_path, "model.layers.1.self_attn.k_proj.weight", "hf", "--weights f32")
