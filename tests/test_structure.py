"""The package's import structure, read from its source (ast: nothing is imported).

The graph: one node per .py module of kestrel_tui (a package is its __init__.py), and an edge M -> X
for every kestrel_tui module X an `import` / `from ... import` statement of M imports, wherever the
statement stands: inside a function too (a lazy import still runs, and a circle through it can still
fail at run time); only statements under `if TYPE_CHECKING:` are left out (they never run). What a
statement imports, relative ones resolved against M's package first:

* `import a.b.c`: the module a.b.c; a package counts as its __init__.py only (the submodules that
  __init__ imports are the __init__'s own edges);
* `from a.b.c import n, ...`: every a.b.c.n that is a module (`from pkg import submodule`), and a.b.c
  itself where some n is no module (an attribute: a.b.c's __init__ must have run that far) or M is
  not inside a.b.c; `from . import sub` in a package's module names only the submodule;
* with both: the packages above a.b.c that Python imports first (a, a.b), except the ones M is
  inside (they were imported before M).

Checked:

(a) the graph has no cycle, the command line's modules included; the message writes each as
    `a -> b -> a` with the file:line of each import in it;
(b) the CLI modules (cli.py; commands.py, its subcommands; bench.py, which only `kestrel-tui bench`
    uses; terminal.py, what the three share) are imported by nothing but each other (and
    kestrel_tui/__main__.py, were there one): the library, the app and the engines never import the
    command line;
(c) no module of the engines (engines/) imports the session layer (session/), lazily or not: what an
    engine returns lives below both (trace/run.py), and the session imports the engines;
(d) every import runs down the layers of docs/architecture.md (LAYERS), never up: the compiled
    reference imports the backends' interface, and the backends never import it; and nothing below
    cli.py, commands.py and bench.py imports argparse: the rest takes session/inputs.RunConfig;
(e) the engines' key maps (hf's CAPTURED / KV_MADE, llama.cpp's NODES / _CAPTURED / KV_MADE) name
    exactly the field registry's fields (trace/fields.py), both ways;
(f) no module takes another module's private name (one that starts with `_`, not a dunder): no
    `from X import _name`, no `X._name` on a module X it imported; what two modules share is public.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = "kestrel_tui"
ROOT = Path(__file__).resolve().parents[1] / PKG
CLI = {f"{PKG}.cli", f"{PKG}.commands", f"{PKG}.bench", f"{PKG}.terminal"}
CLI_IMPORTERS = CLI | {f"{PKG}.__main__"}  # who may import a CLI module
ENGINES, SESSION = f"{PKG}.engines", f"{PKG}.session"
ARGPARSE_OK = {f"{PKG}.cli", f"{PKG}.commands", f"{PKG}.bench"}  # the command line proper
# From the top down; a module may import its own layer and any below it. The package's own
# __init__ and the foundations are the bottom.
LAYERS = (
    ("CLI", ("cli", "commands", "bench", "terminal")),
    ("app", ("app", "perf")),
    ("session", ("session",)),
    ("engines", ("engines",)),
    ("compiled reference", ("cref",)),
    ("backends", ("backends",)),
    ("numerics", ("numerics",)),
    ("model, trace", ("model", "trace")),
    ("foundations", ("", "errors", "bounds", "files", "readers", "text", "procs")),
)


def _modules() -> dict[str, Path]:
    """module name -> file, for every .py of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """The lines of `if TYPE_CHECKING:` bodies (imports there never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for sub in node.body:
                    lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _targets(importer: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The kestrel_tui modules one import statement of `importer` imports (its own edges' heads)."""
    named: set[str] = set()  # the modules the statement names
    if isinstance(node, ast.Import):
        named = {a.name for a in node.names}
    else:
        if node.level:
            base = importer.split(".") if _is_package(importer) else importer.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        subs = {f"{mod}.{a.name}" for a in node.names} & MODULES.keys()  # `from pkg import submodule`
        # the module itself, unless every name is a submodule of a package M is inside
        if len(subs) < len(node.names) or not importer.startswith(mod + "."):
            named.add(mod)
        named |= subs
    out = set()
    for mod in named:
        if not (mod == PKG or mod.startswith(PKG + ".")):
            continue
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in MODULES and (name == mod or not importer.startswith(name + ".")):
                out.add(name)
    out.discard(importer)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module: the line of its first import}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in skip:
                for target in _targets(name, node):
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def _where(graph, a: str, b: str) -> str:
    return f"{MODULES[a].relative_to(ROOT.parent)}:{graph[a][b]}"


def _components(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:  # recursive: a hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _path(graph, comp: set[str], src: str, dst: str) -> list[str]:
    """A shortest path src -> ... -> dst inside comp (breadth first)."""
    prev = {src: src}
    queue = [src]
    while dst not in prev:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w in comp and w not in prev:
                prev[w] = v
                queue.append(w)
    path = [dst]
    while path[0] != src:
        path.insert(0, prev[path[0]])
    return path


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: for every import inside a circle, the shortest circle through it, each as
    its modules in order from the alphabetically first, which ends it again (`a -> b -> a`)."""
    cycles = set()
    for comp in _components(graph):
        for a in sorted(comp):
            for b in sorted(set(graph[a]) & comp):
                ring = _path(graph, comp, b, a)  # a imports b, and b leads back to a
                first = ring.index(min(ring))
                ring = ring[first:] + ring[:first]
                cycles.add(tuple(ring + [ring[0]]))
    return sorted(map(list, cycles))


def _chain(graph, cycle: list[str]) -> str:
    short = [m.removeprefix(PKG + ".") for m in cycle]
    steps = ", ".join(f"{_where(graph, a, b)} imports {b.removeprefix(PKG + '.')}"
                      for a, b in zip(cycle, cycle[1:]))
    return f"{' -> '.join(short)}  ({steps})"


def cli_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a CLI module by a module not allowed one, as `file:line imports module`."""
    return sorted(f"{_where(graph, a, b)} imports {b}" for a, edges in graph.items() for b in edges
                  if b in CLI and a not in CLI_IMPORTERS)


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def session_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a session-layer module by an engines module, as `file:line imports module`."""
    return sorted(f"{_where(graph, a, b)} imports {b}" for a, edges in graph.items() if _inside(a, ENGINES)
                  for b in edges if _inside(b, SESSION))


def test_the_reader_resolves_imports_as_python_does():
    """The rules above on the package's own statements (this test's reader, checked)."""
    def targets(importer, src):
        return _targets(importer, ast.parse(src).body[0])

    cuda = f"{PKG}.backends.cuda"
    assert targets(f"{PKG}.engines.build", "from ..backends.cuda import graph") == \
        {f"{PKG}.backends", cuda, f"{cuda}.graph"}
    assert targets(f"{PKG}.engines.build", f"import {cuda}") == {f"{PKG}.backends", cuda}
    assert targets(f"{cuda}.graph", "from . import pdl") == {f"{cuda}.pdl"}  # the package: imported first
    assert targets(f"{cuda}.graph", "from . import make_cuda_backend") == {cuda}  # a name of its __init__
    assert targets(f"{cuda}.graph", "from . import pdl, make_cuda_backend") == {cuda, f"{cuda}.pdl"}
    assert targets(f"{cuda}.graph", "from .pdl import PdlLauncher") == {f"{cuda}.pdl"}
    assert targets(f"{cuda}.graph", "from ...engines.base import EngineSpec") == \
        {f"{PKG}.engines", f"{PKG}.engines.base"}
    assert targets(cuda, "from .backend import CudaBackend") == {f"{cuda}.backend"}
    assert targets(f"{PKG}.cli", "from . import commands") == {f"{PKG}.commands"}
    assert targets(f"{PKG}.cli", "import numpy") == set()
    assert find_cycles({"a": {"b": 1}, "b": {"c": 2, "a": 3}, "c": {}}) == [["a", "b", "a"]]
    assert find_cycles({"a": {"b": 1}, "b": {"a": 1, "c": 1}, "c": {"b": 1}}) == [["a", "b", "a"], ["b", "c", "b"]]
    assert cli_imports({f"{PKG}.app.app": {f"{PKG}.cli": 3}, f"{PKG}.commands": {f"{PKG}.cli": 1}}) == \
        [f"{PKG}/app/app.py:3 imports {PKG}.cli"]
    assert session_imports({f"{ENGINES}.hf": {f"{SESSION}.session": 7, f"{PKG}.trace.run": 2},
                            f"{SESSION}.iso": {f"{ENGINES}.builtin": 1}, f"{PKG}.engineering": {}}) == \
        [f"{PKG}/engines/hf.py:7 imports {SESSION}.session"]


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(_chain(graph, c) for c in cycles)


def test_nothing_imports_the_cli():
    bad = cli_imports(import_graph())
    assert not bad, ("only cli.py, commands.py, bench.py, terminal.py (and __main__.py) may import the CLI"
                     " modules:\n" + "\n".join(bad))


def test_engines_import_nothing_of_the_session_layer():
    bad = session_imports(import_graph())
    assert not bad, ("the engines (engines/) may not import the session layer (session/); what they return"
                     " lives in trace/run.py:\n" + "\n".join(bad))


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, (_, tops) in enumerate(LAYERS):
        if top in tops:
            return rank
    raise AssertionError(f"{module}: in no layer of LAYERS; give its folder one (docs/architecture.md)")


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a module in a higher layer, as `file:line imports module (layer a -> layer b)`."""
    return sorted(f"{_where(graph, a, b)} imports {b} ({LAYERS[layer_of(a)][0]} -> {LAYERS[layer_of(b)][0]})"
                  for a, edges in graph.items() for b in edges if layer_of(b) < layer_of(a))


def argparse_imports() -> list[str]:
    out = []
    for name, path in MODULES.items():
        if name in ARGPARSE_OK:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "argparse" or n.startswith("argparse.") for n in names):
                out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return sorted(out)


def test_the_layer_checks_can_fail():
    assert upward_imports({f"{PKG}.backends.base": {f"{PKG}.cref.backend": 24},
                           f"{PKG}.cref.backend": {f"{PKG}.backends.base": 16}}) == \
        [f"{PKG}/backends/base.py:24 imports {PKG}.cref.backend (backends -> compiled reference)"]
    assert layer_of(f"{PKG}.engines.hf") < layer_of(f"{PKG}.backends.base") < layer_of(f"{PKG}.errors")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of(f"{PKG}.newfolder.x")


def test_every_import_runs_down_the_layers():
    bad = upward_imports(import_graph())
    assert not bad, "imports that run up the layers (tests/test_structure.py LAYERS):\n" + "\n".join(bad)


def test_nothing_below_the_command_line_sees_argparse():
    bad = argparse_imports()
    assert not bad, ("argparse belongs to cli.py, commands.py and bench.py; below them the options are a"
                     " RunConfig (session/inputs.py):\n" + "\n".join(bad))


# ---- (e) the engines' key maps are the field registry ----------------------------------------

def _table(path: Path, name: str) -> dict:
    """A module-level literal table, read from the source (no torch needed to check it)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} has no {name}")


def _both_ways(engine: str, made: set[str]) -> None:
    from kestrel_tui.trace.fields import NAMES

    assert not made - set(NAMES), f"{engine} names fields the registry lacks: {sorted(made - set(NAMES))}"
    assert not set(NAMES) - made, f"{engine} makes no key of the registry's {sorted(set(NAMES) - made)}"


def test_the_key_map_check_can_fail():
    from kestrel_tui.trace.fields import NAMES

    with pytest.raises(AssertionError, match="lacks"):
        _both_ways("x", set(NAMES) | {"no_such_field"})
    with pytest.raises(AssertionError, match="makes no key"):
        _both_ways("x", set(NAMES) - {"logits"})


def test_hf_key_map_is_the_registry():
    path = ROOT / "engines" / "hf_hooks.py"
    captured, made = _table(path, "CAPTURED"), _table(path, "KV_MADE")
    assert not set(captured) & set(made)
    assert set(made.values()) <= set(captured)
    _both_ways("hf", set(captured) | set(made))


def test_llamacpp_key_map_is_the_registry():
    from kestrel_tui.engines import llamacpp as lc

    by_op = {lc._field(base, op) for base in ("Kcur", "Vcur", "Qcur") for op in ("MUL_MAT", "RESHAPE", "ROPE")}
    from_graph = (set(lc.NODES.values()) | by_op) - {None}
    assert from_graph == set(lc._CAPTURED)
    assert set(lc.KV_MADE.values()) <= from_graph and not set(lc.KV_MADE) & from_graph
    _both_ways("llama.cpp", {"emb", "logits"} | from_graph | set(lc.KV_MADE))


# ---- (f) nothing private crosses a module -------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if _is_package(importer) else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(name: str, tree: ast.AST) -> set[str]:
    """The other modules' private names module ``name`` takes, as `module._name`: `from X import _name`,
    and `X._name` where X is a kestrel_tui module it bound by an import."""
    out, bound = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(name, node)
            if not (mod == PKG or mod.startswith(PKG + ".")):
                continue
            for a in node.names:
                if f"{mod}.{a.name}" in MODULES:  # a module, bound as a name
                    bound[a.asname or a.name] = f"{mod}.{a.name}"
                elif _private(a.name) and mod != name:
                    out.add(f"{mod}.{a.name}")
        elif isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and _private(node.attr) and bound[node.value.id] != name:
            out.add(f"{bound[node.value.id]}.{node.attr}")
    return out


def private_imports() -> list[str]:
    """Every private name taken across modules in the package, as `file: module._name`."""
    return sorted(f"{path.relative_to(ROOT.parent)}: {use}" for name, path in MODULES.items()
                  for use in private_uses(name, ast.parse(path.read_text(), str(path))))


def test_the_private_name_check_can_fail():
    engines_hf = f"{PKG}.engines.hf"

    def uses(src):
        return private_uses(f"{PKG}.engines.hf_dist", ast.parse(src))

    assert uses("from .hf import _line, make_hf_engine") == {f"{engines_hf}._line"}
    assert uses("from kestrel_tui.engines.hf import _quiet") == {f"{engines_hf}._quiet"}
    assert uses("from . import hf\nhf._cuda_ok()") == {f"{engines_hf}._cuda_ok"}
    assert uses("import kestrel_tui.engines.hf as h\nh._cuda_ok()") == {f"{engines_hf}._cuda_ok"}
    assert uses("from . import hf\nhf.cuda_ok(); hf.__name__; self._x; from numpy import _x") == set()
    assert uses("from .hf_dist import _ours") == set()  # its own


def test_no_private_name_crosses_a_module():
    bad = private_imports()
    assert not bad, "a module takes another's private name; give it a public one:\n" + "\n".join(bad)
