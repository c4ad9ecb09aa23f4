"""The import layers of ../shared/DESIGN.md hold: imports run downward only, and no module imports itself back
through others. Lazy imports inside functions count: they make the same circle, only later."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = {
    0: "target attention packed native config errors progress util",
    1: "train decode drafters data store vocab online backends",
    2: "evaluate tune formats engines serve bench",
    3: "stages",
    4: "pipeline run_report run_status",
    5: "cli launch",
}
LAYER = {top: n for n, tops in LAYERS.items() for top in tops.split()}
NEVER = {"backends": ("data", "store")}  # same layer, one direction: data/ and store.py call backends


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the draftsmith modules it imports anywhere in its body (function-level imports included)."""
    modules = {module_name(p): p for p in (SRC / "draftsmith").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def top(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


GRAPH = import_graph()


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if top(m) in LAYER))
def test_imports_run_downward(module):
    up = [d for d in GRAPH[module] if LAYER.get(top(d), -1) > LAYER[top(module)]]
    banned = [d for d in GRAPH[module] if top(d) in NEVER.get(top(module), ())]
    assert not up, f"{module} (layer {LAYER[top(module)]}) imports from a higher layer: {up}"
    assert not banned, f"{module} imports {banned}; DESIGN.md says those call it, not the reverse"


def test_every_module_has_a_layer():
    assert {top(m) for m in GRAPH} - set(LAYER) <= {"", "pipelines"}


def test_no_import_circles():
    """Depth-first search for a back edge; the failure names the circle."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(dep) :], dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_checker_sees_a_circle_and_an_upward_import(monkeypatch):
    """The checks above would pass on an empty graph; here they are shown to fail on a made-up bad one."""
    monkeypatch.setitem(GRAPH, "draftsmith.target", GRAPH["draftsmith.target"] | {"draftsmith.data.tokenize"})
    with pytest.raises(AssertionError, match="import circle"):
        test_no_import_circles()
    monkeypatch.setitem(GRAPH, "draftsmith.drafters", {"draftsmith.formats.load"})
    with pytest.raises(AssertionError, match="higher layer"):
        test_imports_run_downward("draftsmith.drafters")
