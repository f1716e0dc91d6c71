"""The package's layout is its architecture (issue 17): layers import only downwards, no cycles.

Every ``import`` of a flashlab module counts, module-level or inside a function: a lazy import
that points up the layers, or closes a cycle, is the same dependency postponed.
"""
import ast
from pathlib import Path

import pytest

import flashlab

ROOT = Path(flashlab.__file__).resolve().parent

#: Low to high: a module may import its own subpackage and the ones before it (same order as the
#: package docstring of ``flashlab/__init__.py``).
LAYERS = ["compat", "contract", "ladder", "kernels", "dispatch", "serving", "scale",
          "instruments", "models", "viz", "widgets", "benchmarks"]
TOP_LEVEL = {"flashlab", "flashlab.__main__"}     # the public face and the CLI import anything


def _modules():
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _imports(name, path):
    """The flashlab modules ``name`` imports (resolving ``from pkg import module``)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in MODULES else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("flashlab"):
                out.add(arg.value)
    return {m for m in out if m.startswith("flashlab") and m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name):
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_lives_in_a_layer():
    loose = [m for m in MODULES if m not in TOP_LEVEL and _layer(m) is None]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m not in TOP_LEVEL))
def test_imports_point_down_the_layers(name):
    up = sorted(m for m in GRAPH[name] if m in TOP_LEVEL or _layer(m) > _layer(name))
    assert not up, f"{name} (layer {LAYERS[_layer(name)]}) imports higher layers: {up}"


def test_no_import_cycles():
    """Tarjan's strongly connected components over module imports (lazy ones included)."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on.add(v)
        for w in GRAPH.get(v, ()):
            if w in TOP_LEVEL or (w.startswith(v + ".") and v + ".__init__" not in MODULES
                                  and MODULES[v].name == "__init__.py"):
                continue        # a package importing its own modules is not a cycle
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index and v not in TOP_LEVEL:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, f"modules over ~400 lines (split them by what they do): {long}"
