"""Module layering: no import cycles in the server or the client (counting every import, wherever it is
written), and the client never imports the server."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"samrollout": ROOT / "service" / "samrollout", "samrollout_client": ROOT / "clients" / "samrollout_client"}


def _module_name(package: str, root: Path, path: Path) -> str:
    return ".".join([package, *path.relative_to(root).with_suffix("").parts]).removesuffix(".__init__")


def _imports(package: str, root: Path, path: Path) -> set[str]:
    """Modules of ours that ``path`` imports anywhere: at module level, inside functions and under
    ``TYPE_CHECKING`` alike (a cycle hidden in a function or a type check is still a cycle); relative
    imports resolved."""
    module = _module_name(package, root, path)
    parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = parts[:len(parts) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    raw = {_module_name(package, root, path): _imports(package, root, path)
           for package, root in PACKAGES.items() for path in root.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in raw:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, names in raw.items():
        graph[module] = {target for name in names if (target := known(name)) is not None and target != module}
    return graph


def test_no_module_imports_itself_through_a_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = [*path[path.index(target):], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_client_never_imports_the_server() -> None:
    """The trainer-side client installs without the server (no vLLM, no torch); the server may use the client's
    torch-free modules (the prompt identity)."""
    graph = _graph()
    offending = {module: sorted(t for t in targets if t.split(".")[0] == "samrollout")
                 for module, targets in graph.items() if module.startswith("samrollout_client")}
    assert not {module: targets for module, targets in offending.items() if targets}
