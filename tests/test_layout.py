"""The package's import structure, read from the source with ast (nothing is imported).

- No import circles among kvarn's modules, in two senses: (1) every import, at module level or
  inside a function, as an edge between modules: a circle there is two modules that each need the
  other; (2) module-level imports only, where importing ``a.b.c`` also runs the ``__init__`` of each
  package above it that the importer is not itself inside: a circle there fails at import time,
  depending on which module is imported first.
- The library never imports the analysis tool (``kvarn.analysis``): only the CLI may.
- No module imports another module's private (underscore) names.

``kvarn/integrations/vllm`` and its plugin module are left out: they keep their own structure.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KVARN = ROOT / "kvarn"
EXCLUDED = ()
# Modules allowed to import the analysis tool: the tool itself and the command line.
ANALYSIS_USERS = ("kvarn.analysis", "kvarn.cli")


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


MODULES = {_name(p): p for p in sorted(KVARN.rglob("*.py"))}
PACKAGES = {_name(p) for p in KVARN.rglob("__init__.py")}


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str):
    """``(target module, imported names, at module level)`` for each kvarn import of module ``name``;
    imports under ``if TYPE_CHECKING:`` are left out (they never run)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if name in PACKAGES else name.rpartition(".")[0]
    out = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, [], top) for a in child.names if _inside(a.name, "kvarn"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                if not _inside(module, "kvarn"):
                    continue
                names = [a.name for a in child.names]
                submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
                plain = [n for n in names if f"{module}.{n}" not in MODULES]
                if plain or not submodules:  # ``from . import sibling`` needs the sibling, not the package
                    out.append((module, plain, top))
                out.extend((m, [], top) for m in submodules)
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            visit(child, top and not nested)

    visit(tree, True)
    return out


def _graph(runtime: bool) -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        if any(_inside(name, e) for e in EXCLUDED):
            continue
        edges = set()
        for target, _, top in _imports(name):
            if runtime and not top:
                continue
            if any(_inside(target, e) for e in EXCLUDED):
                continue
            edges.add(target)
            if runtime:  # the packages above the target that the importer is not inside
                parts = target.split(".")
                edges.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                             if not _inside(name, p))
        graph[name] = {t for t in edges if t in MODULES and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("runtime", [False, True], ids=["every-import", "module-level-with-packages"])
def test_no_import_circles(runtime):
    cycle = _cycle(_graph(runtime))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_library_never_imports_the_analysis_tool():
    offenders = [
        (name, target) for name in MODULES
        if not any(_inside(name, u) for u in ANALYSIS_USERS)
        for target, _, _ in _imports(name) if _inside(target, "kvarn.analysis")
    ]
    assert offenders == []


def test_no_module_imports_private_names_of_another():
    offenders = [
        (name, target, n) for name in MODULES if not any(_inside(name, e) for e in EXCLUDED)
        for target, names, _ in _imports(name) if target != name
        for n in names if n.startswith("_") and not n.startswith("__")
    ]
    assert offenders == []


def test_the_graph_sees_the_codec_and_a_circle():
    # The checks above are only as good as the graph: it must find the codec's imports, and a circle.
    assert "kvarn.codec.tiles" in _graph(False)["kvarn.codec.flavour"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
