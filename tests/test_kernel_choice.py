"""The cuda backend's kernel choice against the op registry (backends/toggles.py), both ways.

select_kernels (backends/cuda/launches.py) runs here on a stand-in runtime whose kernels are
(module, name) records, so no GPU and no nvcc are needed: every kernel it picks is the
registry's kernel of the version the op's toggle asks for (or one of the few kernels without
versions), every registry kernel of each version is picked for some weights/cache format, the
step's flags carry exactly the bits of the ops switched to exact, and switching one toggle
changes that op's kernels and flags and nothing else. The module each role names is checked
against the preprocessed kernel sources where nvcc is on PATH.
"""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
from dataclasses import dataclass, fields
from types import SimpleNamespace

import pytest

from kestrel_tui.backends.cuda import launches
from kestrel_tui.backends.cuda.launches import Kernels, select_kernels
from kestrel_tui.backends.cuda.options import CudaOptions
from kestrel_tui.backends.toggles import BY_NAME, REGISTRY, TOGGLES

# the kernels of no op: nothing to toggle in them (fused.cu's heads take the ops' flags)
UNVERSIONED = {"embed_q4", "embed_f32", "heads_fused"}
# weights, cache, head_dim: q4_0 or f32 weights; split attention (q8 cache, head_dim 64) or one kernel
FORMATS = [(w, kv, hd) for w in ("q4_0", "f32") for kv in ("q8", "f32") for hd in (64, 80)]
EXACT_SETS = ([frozenset(), frozenset(TOGGLES)] + [frozenset({t}) for t in TOGGLES]
              + [frozenset(TOGGLES) - {t} for t in TOGGLES])
# kernel name -> (op, role)
OWNER = {name: (op, role) for op in REGISTRY for role, k in op.kernels.items() for name in (k.fast, k.exact)}
FLAGS = {flag for op in REGISTRY for flag in op.flags}


@dataclass(frozen=True)
class _Kernel:
    module: str
    name: str

    def set_attribute(self, attr, value) -> None:  # the exact P.V kernel's opt-in
        pass


class _Runtime:
    smem_per_sm = 233472  # an H200's: the exact P.V spread applies

    class cuda:  # noqa: N801 (pycuda.driver's names)
        class function_attribute:  # noqa: N801
            MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def kernel(self, module: str, name: str) -> _Kernel:
        return _Kernel(module, name)


def choose(exact: frozenset[str], weights: str = "q4_0", kv: str = "q8", head_dim: int = 64) -> Kernels:
    model = SimpleNamespace(fmt=weights, cfg=SimpleNamespace(head_dim=head_dim))
    return select_kernels(_Runtime(), model, kv, exact, CudaOptions())


def kernels_of(K: Kernels) -> dict[str, _Kernel]:
    """Kernels' field -> the kernel it holds (the fields that hold one)."""
    return {f.name: getattr(K, f.name) for f in fields(K) if isinstance(getattr(K, f.name), _Kernel)}


@pytest.mark.parametrize("exact", EXACT_SETS, ids=lambda s: ",".join(sorted(s)) or "none")
def test_every_op_runs_the_registry_kernels_of_its_toggles_version(exact):
    used = {op.name: set() for op in REGISTRY}
    for fmt in FORMATS:
        K = choose(exact, *fmt)
        for field, k in kernels_of(K).items():
            if k.name in UNVERSIONED:
                continue
            assert k.name in OWNER, f"{fmt}: Kernels.{field} = {k.name}, a kernel no op of the registry names"
            op, role = OWNER[k.name]
            want = op.kernels[role]
            assert (k.module, k.name) == (want.module, want.version(op.name in exact)), (fmt, field, k)
            used[op.name].add(k.name)
        for flag in FLAGS:  # each flag: the bits of the ops switched to exact, no more
            want_bits = 0
            for op in REGISTRY:
                if op.name in exact:
                    want_bits |= op.flags.get(flag, 0)
            assert getattr(K, flag) == want_bits, (fmt, flag)
    for op in REGISTRY:
        version = "exact" if op.name in exact else "fast"
        assert used[op.name] == set(op.cuda[version]), (op.name, version)


@pytest.mark.parametrize("base", [frozenset(), frozenset(TOGGLES)], ids=["from none", "from all"])
def test_one_toggle_changes_only_its_own_kernels_and_flags(base):
    for fmt in FORMATS:
        before = choose(base, *fmt)
        held = kernels_of(before)
        for op in REGISTRY:
            after = choose(base ^ {op.name}, *fmt)
            changed = {f.name for f in fields(Kernels) if getattr(before, f.name) != getattr(after, f.name)}
            own = {field for field, k in held.items() if OWNER.get(k.name, (None,))[0] is op
                   and op.kernels[OWNER[k.name][1]].fast != op.kernels[OWNER[k.name][1]].exact}
            # the exact P.V kernel's spread goes with the kernel in split_reduce
            spread = {"pv_spread"} if before.split_reduce and OWNER[before.split_reduce.name][0] is op else set()
            assert own | set(op.flags) <= changed <= own | set(op.flags) | spread, (fmt, op.name, changed)
            for flag, bits in op.flags.items():
                assert getattr(before, flag) ^ getattr(after, flag) == bits, (fmt, op.name, flag)


def test_the_kernel_choice_names_roles_never_toggles():
    """launches.py names no toggle: which op a kernel or flag follows is the registry's to say. Role
    names are unique and spelt unlike any toggle, so a role is never mistaken for one."""
    tree = ast.parse(open(launches.__file__).read())
    named = [(node.lineno, node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in BY_NAME]
    assert not named, f"launches.py names toggles by hand: {named}"
    roles = [role for op in REGISTRY for role in op.kernels]
    assert len(roles) == len(set(roles)), sorted(r for r in roles if roles.count(r) > 1)
    assert not set(roles) & set(TOGGLES)
    assert FLAGS <= {f.name for f in fields(Kernels)}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (the kernel sources are preprocessed)")
def test_every_role_names_the_module_that_defines_its_kernels(tmp_path):
    from kestrel_tui.backends.cuda.runtime import module_source

    defined: dict[str, set[str]] = {}
    for module in sorted({k.module for op in REGISTRY for k in op.kernels.values()}):
        src = tmp_path / f"{module}.cu"
        src.write_text(module_source(module))
        text = subprocess.run(["nvcc", "-E", "-x", "cu", str(src)], capture_output=True, text=True,
                              check=True).stdout
        # a kernel's declaration: __global__ (preprocessed to __attribute__((global))), void,
        # perhaps its launch bounds, then its name and parameters
        names = set()
        for decl in text.split("__attribute__((global))")[1:]:
            idents = re.findall(r"(\w+)\s*\(", decl.split("{", 1)[0])
            names.add(next(i for i in idents if i not in ("__attribute__", "launch_bounds")))
        defined[module] = names
    for op in REGISTRY:
        for role, k in op.kernels.items():
            assert {k.fast, k.exact} <= defined[k.module], (op.name, role, k)
