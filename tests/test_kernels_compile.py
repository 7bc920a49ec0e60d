"""The cuda backend's compile-time checks: they run in CI, where there is nvcc but no GPU.

* every kernels/*.cu compiles with the local nvcc for sm_90 (PTX), and every
  kernel the backend launches has the argument format the runtime reads from
  its PTX (runtime.ptx_formats); the PDL trigger is opt-in in the PTX; the
  launch constants have one definition (kernels/launch.cuh, read by
  launches.py and scripts/gpu/gpu_attn_bench.py) and the compiled kernels carry
  the block sizes launches.py gives them;
* the UCRT replica device functions of common.cuh, compiled for the *host* by
  nvcc, equal the numpy replicas (numerics/transcend.py) bit for bit — the same
  source the GPU runs, with the C99 equivalents of its IEEE intrinsics;
* the device weight layout equals ggml's q4_0 bytes, and the hash work list
  folded the way kernels/hash.cu folds it gives trace.fnv's FNV-1a 64.

The whole step run against a fake driver (no nvcc, no GPU) is in test_cuda_fake_driver.py.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kestrel_tui.backends.cuda.launches import SCAN_SEG, SCAN_THREADS
from kestrel_tui.backends.cuda.layout import FNV_PRIME, HASH_CHUNK, HASH_PIECE, HASH_SCAN_MAX, SCAN_MAX, HashWork, Layout
from kestrel_tui.backends.cuda.runtime import KERNEL_DIR, MODULES, nvcc_options
from kestrel_tui.backends.cuda.selfcheck import replica_inputs
from kestrel_tui.backends.cuda.weights import device_q4_0
from kestrel_tui.model.config import default_config
from kestrel_tui.model.quant import q4_0_to_ggml
from kestrel_tui.numerics import transcend
from kestrel_tui.trace.fnv import OFFSET_BASIS, fnv1a64

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (CUDA toolkit not installed)")


def _compile_modules(out: Path, *extra: str) -> Path:
    """Every kernels/*.cu module's PTX in `out`, built with the backend's options and `extra`."""
    for name in MODULES:
        proc = subprocess.run([NVCC, "-arch=sm_90", *nvcc_options(), *extra, "--ptx", "-I", str(KERNEL_DIR),
                               "-o", str(out / f"{name}.ptx"), str(KERNEL_DIR / f"{name}.cu")],
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}.cu {' '.join(extra)} failed to compile:\n{proc.stderr}"
    return out


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory):
    return _compile_modules(tmp_path_factory.mktemp("ptx"))


@needs_nvcc
def test_every_cu_file_is_a_module():
    assert sorted(p.stem for p in KERNEL_DIR.glob("*.cu")) == sorted(MODULES)


@needs_nvcc
def test_kernels_compile_and_give_every_launch_its_format(ptx_dir):
    """The runtime reads each kernel's PyCUDA format from its PTX (runtime.ptx_formats): every kernel
    the op registry names, and the few outside it, has one, and the parser reads the PTX types as
    written (a pointer .u64, an int .u32/.s32, a float .f32)."""
    from kestrel_tui.backends.cuda.runtime import ptx_formats
    from kestrel_tui.backends.toggles import REGISTRY

    entries = {}
    for name in MODULES:
        entries.update(ptx_formats((ptx_dir / f"{name}.ptx").read_text()))
    named = {k for op in REGISTRY for version in op.cuda.values() for k in version}
    named |= {"embed_q4", "embed_f32", "gen_q4", "kv_rows_f32", "heads_fused", "fnv1a64_keys", "fnv_states",
              "fnv_chunks"}
    assert named <= set(entries), sorted(named - set(entries))
    sample = (".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1,\n"
              "\t.param .f32 k_param_2,\n\t.param .s32 k_param_3\n)\n{")
    assert ptx_formats(sample) == {"k": "Pifi"}
    assert entries["rmsnorm_exact"] == "PPPifPPi"  # (x, w, out, n, eps, xq, xd, quant) in norm.cu


@needs_nvcc
def test_pdl_trigger_is_on_unless_turned_off(monkeypatch, tmp_path):
    """The runtime's nvcc options build the kernels to trigger their successors
    (griddepcontrol.launch_dependents after the wait) unless KESTREL_PDL_TRIGGER turns it off:
    both paths are faster with it (results/gpu-h200-speed.md)."""
    def ptx(trigger: str | None) -> str:
        if trigger is None:
            monkeypatch.delenv("KESTREL_PDL_TRIGGER", raising=False)
        else:
            monkeypatch.setenv("KESTREL_PDL_TRIGGER", trigger)
        out = tmp_path / f"norm_{trigger}.ptx"
        proc = subprocess.run([NVCC, "-arch=sm_90", *nvcc_options(), "--ptx", "-I", str(KERNEL_DIR), "-o", str(out),
                               str(KERNEL_DIR / "norm.cu")], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return out.read_text()

    for trigger in ("0", "off"):
        text = ptx(trigger)
        assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" not in text
    for trigger in (None, "1"):
        assert "griddepcontrol.launch_dependents" in ptx(trigger)


LAUNCH_CONSTANTS = ("ATT_SPLIT_TILE", "ATT_PV_STAGE", "ATT_PV_THREADS", "ATT_FAST_TILE", "ATT_FAST_WARPS",
                    "GEMV_ROWS1", "EXPERT_ROWS", "FUSED_MAX_ROW", "COMBINE_MAX_K", "SWIGLU_THREADS")


def test_launch_constants_have_one_definition():
    """launches.py sizes grids, blocks and scratch by the kernels' constants, read from
    kernels/launch.cuh: each is defined there and in no other kernels file (no copy to drift)."""
    from kestrel_tui.backends.cuda import launches

    header = set(re.findall(r"^#define (\w+) ", (KERNEL_DIR / "launch.cuh").read_text(), flags=re.M))
    assert set(LAUNCH_CONSTANTS) <= header
    for f in KERNEL_DIR.iterdir():
        if f.suffix in (".cu", ".cuh", ".h") and f.name != "launch.cuh":
            again = set(re.findall(r"^\s*#define (\w+)", f.read_text(), flags=re.M)) & set(LAUNCH_CONSTANTS)
            assert not again, f"{f.name} defines {sorted(again)} again"
    assert launches.ATT_PV_THREADS == 64 + launches._C["ATT_PV_STAGE"]  # two serial warps + the producers


@needs_nvcc
def test_launch_constants_are_the_compiled_kernels(ptx_dir):
    """The block sizes launches.py gives the kernels with __launch_bounds__ are those the compiled
    kernels carry (.maxntid in the PTX)."""
    from kestrel_tui.backends.cuda import launches

    def maxntid(module: str, kernel: str) -> int:
        ptx = (ptx_dir / f"{module}.ptx").read_text()
        return int(re.search(rf"\.entry {kernel}\([^)]*\)\s*\.maxntid (\d+)", ptx).group(1))

    assert maxntid("attention", "attn_exact_pv_q8") == launches.ATT_PV_THREADS
    assert maxntid("attention", "attn_fast_part_q8") == 32 * launches.ATT_FAST_WARPS
    # a block: 32 rows (one q8_0 block of silu's output) of gate and of up, EXPERT_ROWS a warp
    assert launches.SWIGLU_THREADS == 2 * 32 // launches.EXPERT_ROWS * 32
    for version in ("fast", "exact"):
        assert maxntid("fused", f"experts_swiglu_{version}") == launches.SWIGLU_THREADS


def _gpu_script(name: str):
    import importlib.util
    import sys

    folder = Path(__file__).resolve().parents[1] / "scripts" / "gpu"
    sys.path.insert(0, str(folder))  # the scripts import each other (gpu_pv_trace: gpu_attn_bench)
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up while the class is made
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(folder))
    return mod


@needs_nvcc
@pytest.mark.parametrize("script", ["gpu_chain_floor", "gpu_l2_probe", "gpu_serial_floor", "gpu_pv_trace",
                                    "gpu_norm_bench"])
def test_gpu_scripts_cuda_sources_compile(script, tmp_path):
    """The GPU scripts' own kernels (their SRC, or for gpu_pv_trace the committed P.V kernel with its
    trace points put in) compile for sm_90: a script is often changed on a machine without a GPU."""
    from kestrel_tui.backends.cuda.runtime import module_source

    mod = _gpu_script(script)
    if script == "gpu_pv_trace":
        src = module_source("attention", mod.traced((KERNEL_DIR / "attention.cu").read_text()))
        assert "attn_pv_trace" in src
    else:  # gpu_norm_bench's SRC includes kernels/norm.cuh: source() inlines it
        src = mod.source() if hasattr(mod, "source") else mod.SRC
    cu = tmp_path / f"{script}.cu"
    cu.write_text(src)
    proc = subprocess.run([NVCC, "-arch=sm_90", *nvcc_options(), "--ptx", "-o", str(cu.with_suffix(".ptx")), str(cu)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
def test_stamped_build_compiles_and_stamps_every_kernel(tmp_path):
    """gpu_step_timeline.py builds every module with -DKESTREL_STAMPS and reads each kernel's stamp:
    every kernel must still compile, and every one must reach the stamp (through pdl_wait), or the
    timeline would lose it."""
    timeline = _gpu_script("gpu_step_timeline")
    cap = re.search(r"#define KESTREL_STAMP_CAP (\d+)", (KERNEL_DIR / "common.cuh").read_text())
    assert cap and int(cap[1]) == timeline.CAP
    _compile_modules(tmp_path, "-DKESTREL_STAMPS")
    for name in MODULES:
        text = (tmp_path / f"{name}.ptx").read_text()
        entries = list(re.finditer(r"\.entry\s+(\w+)\s*\(.*?\n}\n", text, flags=re.S))
        assert len(entries) == text.count(".entry") > 0
        for m in entries:
            assert "%globaltimer" in m[0], f"{name}.cu {m[1]} writes no stamp (does it call pdl_wait?)"


def test_timeline_rows_split_a_kernel_by_its_grids():
    """gpu_step_timeline.py packs a launch's shape as kestrel_stamp does (grid x, y, z, block x in
    16-bit fields) and gives a kernel that runs with several grids a row per grid (gemv_q4: o_proj,
    the router, lm_head), one row otherwise."""
    t = _gpu_script("gpu_step_timeline")
    assert t.shape((3, 2, 1), (256, 1, 1)) == 3 | 2 << 16 | 1 << 32 | 256 << 48
    launches = [("gemv_q4_fast", t.shape((128, 1, 1), (128, 1, 1))), ("rmsnorm_fast", t.shape((1, 1, 1), (256, 1, 1))),
                ("gemv_q4_fast", t.shape((8, 1, 1), (128, 1, 1))), ("rmsnorm_fast", t.shape((1, 1, 1), (256, 1, 1)))]
    assert t.labels(launches) == ["gemv_q4_fast grid 128x1x1", "rmsnorm_fast", "gemv_q4_fast grid 8x1x1",
                                  "rmsnorm_fast"]


def test_hash_share_reads_kernel_nodes_as_cuda_h_lays_them_out():
    """gpu_hash_share.py finds the body hash's graph node by its grid in CUDA_KERNEL_NODE_PARAMS_v2
    (cuda.h: func, grid and block dims, shared bytes, kernelParams, extra, kern, ctx)."""
    import ctypes

    kp = _gpu_script("gpu_hash_share").KernelParams
    assert [getattr(kp, f).offset for f in ("func", "grid", "block", "shared", "params", "extra", "kern", "ctx")] \
        == [0, 8, 20, 32, 40, 48, 56, 64] and ctypes.sizeof(kp) == 72


def _bits_run(keys: dict, device_ms: float) -> dict:
    return {"bits": {"30b4 fast graph": dict(keys)}, "ms": {"fast (device)": device_ms}}


def test_same_bits_ab_alternates_the_trees_and_reports_every_pair(tmp_path, monkeypatch, capsys):
    """gpu_same_bits.py --ab runs --out in the two trees one process after the other (a, b, a, b),
    each with its own tree first on PYTHONPATH and as its working folder, and prints a section as
    the same bits only if every pair agrees, each process's device time and the medians."""
    sb = _gpu_script("gpu_same_bits")
    trees = [tmp_path / "before", tmp_path / "after"]
    for t in trees:
        t.mkdir()
    monkeypatch.setenv("PYTHONPATH", "/site")
    calls = []
    figures = iter([2.03, 2.05, 2.04, 2.06])
    second_pair_differs = {"t0_l0_x": "1", "t0_l1_x": "2"}

    def fake_run(cmd, cwd, env):
        calls.append((Path(cwd).name, env["PYTHONPATH"]))
        out = Path(cmd[cmd.index("--out") + 1])
        keys = second_pair_differs if len(calls) == 4 else {"t0_l0_x": "1", "t0_l1_x": "3"}
        out.write_text(json.dumps(_bits_run(keys, next(figures))))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sb.subprocess, "run", fake_run)
    sb.ab([str(t) for t in trees], 2, tmp_path / "runs", 30)
    assert calls == [(t.name, f"{t.resolve()}{os.pathsep}/site") for t in trees * 2]
    text = capsys.readouterr().out
    assert "1 keys differ (2 pairs), first t0_l1_x" in text
    assert "2.030 / 2.040 -> 2.050 / 2.060 ms; median 2.035 -> 2.055 (+0.020)" in text
    same = sb.summary([_bits_run({"k": "1"}, 2.0)], [_bits_run({"k": "1"}, 2.1)])
    assert same[0].endswith("same bits") and "(+0.100)" in same[1]

    def failing_run(cmd, cwd, env):
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(sb.subprocess, "run", failing_run)
    with pytest.raises(SystemExit, match="exited with 3"):
        sb.ab([str(t) for t in trees], 1, tmp_path / "runs2", 30)


def test_serial_floor_counts_the_contracts_ordered_sums():
    """gpu_serial_floor.py's chain lengths for Qwen3-30B-A3B at context 1024, from numerics.md's rules:
    R2 over hidden/8 blocks twice a layer and once at the end, R3 over head_dim, the experts and
    the top-k, and one L6d step a cache position."""
    from dataclasses import replace

    from kestrel_tui.model.config import qwen3_30b_a3b_config

    floor = _gpu_script("gpu_serial_floor")
    cfg = qwen3_30b_a3b_config()
    got = floor.chain_lengths(cfg, 1024)
    assert sum(a + b for a, b in got.values()) == 97 * 256 + 48 * 128 + 48 * 128 + 48 * 8 + 48 * 1025
    dense = floor.chain_lengths(replace(cfg, n_layers=4, mlp_only_layers=(1,)), 8)
    assert dense["R3 router softmax sums"] == (3 * 128, 0)  # a dense layer has no router


def test_sass_ctl_decodes_real_cuobjdump_control_bits():
    """scripts/gpu/sass_ctl.py on real cuobjdump -sass output (tests/data: the exact P·V serial
    warp's loop as ptxas built it for sm_90). The field just above the decoded ones, the operand
    reuse flags, is set exactly where cuobjdump prints ".reuse", so the bit positions hold. The
    dependent multiply and add pairs carry 1 + 3 stall cycles, the 4-cycle step that
    gpu_serial_floor.py measures. And a dump cut after an instruction's low word is refused,
    not read short."""
    sass = _gpu_script("sass_ctl")
    text = (Path(__file__).parent / "data" / "sass_attn_exact_pv_q8_serial_loop.txt").read_text()
    ins = sass.parse(text)["attn_exact_pv_q8"]
    assert len(ins) == 25 and ins[0].address == 0x3CC0 and ins[-1].address == 0x3E40
    assert any(i.reuse for i in ins)
    for i in ins:
        assert bool(i.reuse) == (".reuse" in i.text), i.line()
    chain = [i for i in ins if i.text.split()[0] in ("FADD", "FMUL")]
    assert len(chain) == 11 and [i.stall for i in chain[:10]] == [1, 3] * 5
    loads = [i for i in ins if i.text.startswith("LDS")]
    assert len(loads) == 13 and all(i.write_sb != sass.NO_SCOREBOARD for i in loads)
    branch = next(i for i in ins if "BRA" in i.text)
    assert branch.wait_mask != 0  # waits for the loads it needs before the chain starts
    cut = text.rsplit("\n", 2)[0] + "\n"  # the last high word gone
    with pytest.raises(ValueError, match="high word"):
        sass.parse(cut)


@needs_nvcc
def test_sass_ctl_says_in_one_line_what_the_disassembler_lacks(tmp_path, monkeypatch):
    """cuobjdump from its wheel runs nvdisasm, which that wheel does not bring: sass_ctl.py ends
    with one line naming the missing tool and the wheel that has it, not a traceback; and a kernel
    name the .cu (or a saved dump) does not have is said so, not printed as nothing."""
    sass = _gpu_script("sass_ctl")
    fake = tmp_path / "cuobjdump"
    fake.write_text("#!/bin/sh\necho \"cuobjdump fatal   : Could not find executable file 'nvdisasm'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sass, "cuobjdump", lambda: str(fake))
    with pytest.raises(SystemExit) as err:
        sass.disassemble(KERNEL_DIR / "kvquant.cu", "kvquant_exact")
    assert "nvdisasm" in str(err.value) and "pip install nvidia-cuda-nvdisasm" in str(err.value)
    assert "\n" not in str(err.value)
    empty = tmp_path / "empty"
    empty.write_text("#!/bin/sh\nexit 0\n")
    empty.chmod(0o755)
    monkeypatch.setattr(sass, "cuobjdump", lambda: str(empty))
    monkeypatch.setattr(sys, "argv", ["sass_ctl.py", str(KERNEL_DIR / "kvquant.cu"), "no_such_kernel"])
    with pytest.raises(SystemExit) as err:
        sass.main()
    assert str(err.value).startswith("sass_ctl.py: no kernel no_such_kernel in ")
    dump = Path(__file__).parent / "data" / "sass_attn_exact_pv_q8_serial_loop.txt"
    monkeypatch.setattr(sys, "argv", ["sass_ctl.py", "--sass", str(dump), "no_such_kernel"])
    with pytest.raises(SystemExit) as err:
        sass.main()
    assert str(err.value) == f"sass_ctl.py: no kernel no_such_kernel in {dump}"


def test_attn_bench_reads_a_versions_own_block_size():
    """scripts/gpu/gpu_attn_bench.py launches each attention.cu version with the block its own
    #defines give; a wrong block hangs the P.V kernel at its named barrier (it happened once:
    the reader took an #ifndef default over the version's own #define)."""
    from kestrel_tui.backends.cuda import launches
    from kestrel_tui.backends.cuda.runtime import module_source

    bench = _gpu_script("gpu_attn_bench")

    src = module_source("attention")  # kernels/launch.cuh inlined
    assert bench.define(src, "ATT_PV_THREADS") == launches.ATT_PV_THREADS
    assert bench.define(src, "ATT_SPLIT_TILE") == launches.ATT_SPLIT_TILE
    variant = ("#define PPP 2\n#ifndef PPP\n#define PPP 1\n#endif\n"
               "#define STAGE 128\n#define THREADS (32 + PPP * STAGE)\n")
    assert bench.define(variant, "THREADS") == 288


@pytest.fixture(scope="module")
def host_replicas(tmp_path_factory):
    src = tmp_path_factory.mktemp("host") / "replicas.cu"
    src.write_text('#include "common.cuh"\n' + "".join(
        f'extern "C" void host_{f}(const float *x, float *y, long n)'
        f' {{ for (long i = 0; i < n; i++) y[i] = {f}_ucrt(x[i]); }}\n' for f in ("expf", "cosf", "sinf")))
    lib = src.with_suffix(".so")
    proc = subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC,-ffp-contract=off", "-I", str(KERNEL_DIR),
                           "-o", str(lib), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    dll = ctypes.CDLL(str(lib))
    for f in ("expf", "cosf", "sinf"):
        getattr(dll, f"host_{f}").argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return dll


def _call(dll, fn: str, x: np.ndarray) -> np.ndarray:
    y = np.empty_like(x)
    getattr(dll, f"host_{fn}")(x.ctypes.data, y.ctypes.data, x.size)
    return y


@needs_nvcc
@pytest.mark.parametrize("fn", ["expf", "cosf", "sinf"])
def test_host_compiled_replicas_equal_numpy(host_replicas, fn):
    x = replica_inputs(fn, 1_000_000, seed=len(fn))
    got = _call(host_replicas, fn, x)
    want = getattr(transcend, fn)(x)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{fn}: {bad.size} of {x.size} differ, first x={x[bad[0]]!r}:"
                           f" {got[bad[0]]!r} vs {want[bad[0]]!r}")


def test_q4_0_device_layout_is_ggml():
    rng = np.random.default_rng(3)
    qs = rng.integers(-8, 8, (4, 5, 32)).astype(np.int8)  # [nb, out, 32]
    d = rng.uniform(-1, 1, (4, 5)).astype(np.float16).astype(np.float32)
    ggml = q4_0_to_ggml(qs, d)  # [out, nb, 18]
    packed, scales = device_q4_0(ggml)
    assert np.array_equal(packed, ggml[..., 2:])
    assert np.array_equal(scales.view(np.uint8).reshape(5, 4, 2), ggml[..., :2])
    stacked, _ = device_q4_0(q4_0_to_ggml(np.stack([qs, qs[::-1]]), np.stack([d, d[::-1]])))
    assert np.array_equal(stacked[0], packed)


def _fold_onepass(work, arena: bytes) -> list[int]:
    """fnv1a64_keys in numpy: F over 256 starts per chunk, then the fold."""
    mask = (1 << 64) - 1
    starts = np.arange(256, dtype=np.uint64)
    F = []
    for c in range(work.n_chunks):
        data = np.frombuffer(arena, np.uint8, int(work.chunk_len[c]), int(work.chunk_off[c])).astype(np.uint64)
        h = starts.copy()
        with np.errstate(over="ignore"):
            for b in data:
                h = (h ^ b) * np.uint64(FNV_PRIME)
        F.append(h)
    out = []
    for k in range(work.n_keys):
        first, n = int(work.key_first[k]), int(work.key_n[k])
        if n == 0:  # an fnv_scan span (_fold)
            out.append(0)
            continue
        data = np.frombuffer(arena, np.uint8, int(work.chunk_len[first]), int(work.chunk_off[first]))
        h = fnv1a64(data.tobytes()) if data.size else OFFSET_BASIS
        for c in range(first + 1, first + n):
            s = h & 255
            h = ((h - s) * int(work.chunk_pow[c]) + int(F[c][s])) & mask
        out.append(h)
    return out


def _fold_two_pass(work, arena: bytes) -> list[int]:
    """fnv_states + fnv_chunks in numpy: the 8-bit state machine (two states per 32-bit
    word, as a lane runs it) with a snapshot every HASH_PIECE bytes, the walk, one FNV run
    per piece from its true state, and the closed-form sum of the pieces' terms."""
    mask = (1 << 64) - 1
    per = HASH_CHUNK // HASH_PIECE
    snaps = {}
    for c in range(work.n_chunks):
        data = np.frombuffer(arena, np.uint8, int(work.chunk_len[c]), int(work.chunk_off[c])).astype(np.uint32)
        s = np.arange(256, dtype=np.uint32)
        x = s[0::2] | (s[1::2] << np.uint32(16))
        for i, b in enumerate(data):
            x = ((x ^ (b | (b << np.uint32(16)))) & np.uint32(0x00FF00FF)) * np.uint32(0xB3)
            if (i + 1) % HASH_PIECE == 0:
                snap = np.empty(256, np.uint32)
                snap[0::2], snap[1::2] = x & 255, (x >> 16) & 255
                snaps[c, (i + 1) // HASH_PIECE - 1] = snap
    start = {}
    for k in range(work.n_keys):
        first, n = int(work.key_first[k]), int(work.key_n[k])
        s = OFFSET_BASIS & 255
        for c in range(first, first + n):
            start[c] = s
            if c < first + n - 1:
                s = int(snaps[c, per - 1][s])
    out = [0] * work.n_keys
    for c in range(work.n_chunks):
        k = int(work.chunk_key[c])
        for j in range(per):
            ln = int(work.chunk_len[c]) - j * HASH_PIECE
            if ln <= 0:
                if j == 0 and c == work.key_first[k]:
                    out[k] = (out[k] + OFFSET_BASIS) & mask
                break
            s = start[c] if j == 0 else int(snaps[c, j - 1][start[c]])
            basis = j == 0 and c == work.key_first[k]
            h = OFFSET_BASIS if basis else s
            off = int(work.chunk_off[c]) + j * HASH_PIECE
            for b in arena[off:off + min(ln, HASH_PIECE)]:
                h = ((h ^ b) * FNV_PRIME) & mask
            q = c * per + j
            term = h if basis else (h - s * int(work.piece_pow[q])) & mask
            out[k] = (out[k] + term * int(work.piece_spow[q])) & mask
    return out


def _scan_segment(data: bytes, carry: list[int]) -> tuple[list[int], list[int]]:
    """One fnv_scan block in numpy, a row per thread: the eight XOR scans of the low state bits
    over words held as two registers of 16-bit lanes, carry[j] the XOR of the key's earlier
    segments' round-j parities. Returns the threads' start states and the segment's parities."""
    u = np.uint32
    buf = np.zeros(SCAN_MAX, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    w = buf.view("<u4").reshape(SCAN_THREADS, SCAN_SEG // 4)
    my = np.clip(len(data) - np.arange(SCAN_THREADS) * SCAN_SEG, 0, SCAN_SEG)
    live = np.array([(1 << int(n)) - 1 for n in my], np.uint32)
    be, bo = w & u(0x00FF00FF), (w >> u(8)) & u(0x00FF00FF)
    se, so = np.zeros_like(w), np.zeros_like(w)
    parities = []
    for j in range(8):
        mj, t = u(((1 << j) - 1) * 0x00010001), np.zeros(SCAN_THREADS, np.uint32)
        for r in range(SCAN_SEG // 4):
            pe, po = ((se[:, r] ^ be[:, r]) & mj) * u(0xB3), ((so[:, r] ^ bo[:, r]) & mj) * u(0xB3)
            t4 = (((pe ^ be[:, r]) >> u(j)) & u(0x00010001)) | ((((po ^ bo[:, r]) >> u(j)) & u(0x00010001)) << u(1))
            t |= ((t4 | (t4 >> u(14))) & u(0xF)) << u(4 * r)
        t &= live
        for sh in (1, 2, 4, 8, 16):
            t ^= t << u(sh)
        par = (t >> u(31)).astype(np.int64)
        parities.append(int(par.sum() & 1))
        c = (np.cumsum(par) - par + ((OFFSET_BASIS >> j) & 1) + carry[j]) & 1
        e = (t << u(1)) ^ (u(0) - c.astype(np.uint32))
        for r in range(SCAN_SEG // 4):
            e4 = e >> u(4 * r)
            se[:, r] |= ((e4 & u(1)) | ((e4 & u(4)) << u(14))) << u(j)
            so[:, r] |= (((e4 >> u(1)) & u(1)) | ((e4 & u(8)) << u(13))) << u(j)
    return (se[:, 0] & u(255)).tolist(), parities


def _fold_scan(work, arena: bytes, out: list[int]) -> None:
    """fnv_scan over a work list's segments, a key's in order (the look-back's carries), each
    thread's FNV-1a term with the kernel's powers of P; the key's sum into out."""
    mask = (1 << 64) - 1
    carry = {}
    for g in range(work.n_seg):
        k, first, ln = int(work.seg_key[g]), int(work.seg_first[g]), int(work.seg_len[g])
        off = int(work.seg_off[g])
        data = arena[off:off + ln]
        if g == first:
            carry[k], out[k] = [0] * 8, 0
        starts, parities = _scan_segment(data, carry[k])
        carry[k] = [c ^ p for c, p in zip(carry[k], parities)]
        nsg = -(-ln // SCAN_SEG)
        last = ln - (nsg - 1) * SCAN_SEG
        for tid in range(max(1, nsg)):
            my = max(0, min(SCAN_SEG, ln - tid * SCAN_SEG))
            basis = g == first and tid == 0
            h = OFFSET_BASIS if basis else starts[tid]
            for b in data[tid * SCAN_SEG:tid * SCAN_SEG + my]:
                h = ((h ^ b) * FNV_PRIME) & mask
            if not (basis or my):
                continue
            term = h if basis else (h - starts[tid] * int(work.pow_word[my // 4])) & mask
            if tid < nsg - 1:
                term = term * int(work.pow_seg[nsg - 2 - tid]) * int(work.pow_word[last // 4]) & mask
            out[k] = (out[k] + term * int(work.seg_pow[g])) & mask


def _fold(work, arena: bytes, chunks=None) -> list[int]:
    """A work list's hashes: its fnv_scan keys by _fold_scan, the chunked ones by `chunks` (by
    default _fold_two_pass)."""
    out = (chunks or _fold_two_pass)(work, arena)
    _fold_scan(work, arena, out)
    return out


def test_scan_hash_is_fnv1a64_at_every_edge():
    """fnv_scan's arithmetic (its numpy replica) on lengths at each edge of a thread's bytes, of
    the block and of a key's segments, on random, zero and all-ones bytes (the low state runs
    through other values)."""
    rng = np.random.default_rng(11)
    lengths = [0, 4, 28, 32, 36, 64, 1020, 1024, 1028, SCAN_MAX - 4, SCAN_MAX, SCAN_MAX + 4, 2 * SCAN_MAX + 36,
               *rng.integers(1, SCAN_MAX // 4, 4) * 4, *rng.integers(SCAN_MAX // 4, SCAN_MAX, 2) * 4]
    for fill in ("random", "zeros", "ones"):
        arena = {"random": rng.integers(0, 256, sum(lengths), dtype=np.uint8).tobytes(), "zeros": bytes(sum(lengths)),
                 "ones": b"\xff" * sum(lengths)}[fill]
        spans = [(sum(lengths[:i]), int(n)) for i, n in enumerate(lengths)]
        work = HashWork(spans, scan_max=HASH_SCAN_MAX)
        assert work.n_chunks == 0 and max(work.seg_n) == 3
        assert _fold(work, arena) == [fnv1a64(arena[o:o + n]) for o, n in spans], fill


def test_hash_work_list_folds_to_fnv1a64():
    cfg = default_config().with_layers(1)
    from dataclasses import replace

    cfg = replace(cfg, vocab=2500)  # logits of 10000 bytes: three chunks, a short last one
    lay = Layout(cfg, "q8", 2, deep=True)
    arena = np.random.default_rng(5).integers(0, 256, lay.total, dtype=np.uint8).tobytes()
    want = []
    for m in range(lay.M):
        for field, layer in lay.key_fields:
            r = lay.regions[field, layer]
            want.append(fnv1a64(arena[r.offset + m * r.col_bytes:r.offset + (m + 1) * r.col_bytes]))
    every = HashWork(lay.spans)  # every key in chunks
    assert _fold_onepass(every, arena) == want
    assert _fold_two_pass(every, arena) == want
    assert max(every.key_n) == 3
    # the split the backend hashes with (body keys on a second stream, then the logits), every key
    # by fnv_scan
    assert lay.hash_body.n_seg == len(lay.body_index) and lay.hash_body.n_chunks == 0
    body, logits = _fold(lay.hash_body, arena), _fold(lay.hash_logits, arena)
    assert np.array(body + logits, dtype=np.uint64)[lay.merge].tolist() == want
    assert len(logits) == lay.M


def test_two_pass_hash_on_odd_spans():
    rng = np.random.default_rng(9)
    lengths = [0, 4, 256, 260, 2048, 2052, 4096 + 512 + 12]
    spans, off = [], 0
    for n in lengths:
        spans.append((off, n))
        off += n + 20
    arena = rng.integers(0, 256, off + 64, dtype=np.uint8).tobytes()
    want = [fnv1a64(arena[o:o + n]) for o, n in spans]
    assert _fold_two_pass(HashWork(spans), arena) == want
    mixed = HashWork(spans, scan_max=2048)  # the short spans by fnv_scan, the others in chunks
    assert mixed.seg_key.tolist() == [0, 1, 2, 3, 4] and mixed.n_chunks == 3
    assert _fold(mixed, arena) == _fold(mixed, arena, _fold_onepass) == want


def test_module_source_reads_the_headers_beside_a_version(tmp_path):
    """The GPU scripts that compare attention.cu versions compile each with its own tree's headers
    (kernels/launch.cuh sizes its blocks), not this tree's."""
    from kestrel_tui.backends.cuda.runtime import module_source

    for f in KERNEL_DIR.iterdir():
        if f.suffix in (".cuh", ".h"):
            (tmp_path / f.name).write_text(f.read_text())
    launch = tmp_path / "launch.cuh"
    assert "#define ATT_PV_STAGE 128 " in launch.read_text()
    launch.write_text(launch.read_text().replace("#define ATT_PV_STAGE 128 ", "#define ATT_PV_STAGE 64 "))
    version = (KERNEL_DIR / "attention.cu").read_text()
    assert "#define ATT_PV_STAGE 64 " in module_source("attention", version, tmp_path)
    assert "#define ATT_PV_STAGE 128 " in module_source("attention", version)
