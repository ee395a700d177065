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


# What the service may import from the client: the wire protocol everywhere; the simulator also follows the
# client's own rules (placement, the partial rollout's), so that a projection runs the rules the trainer runs.
PROTOCOL = "samrollout_client.protocol"
SIMULATOR_RULES = ("samrollout_client.placement", "samrollout_client.rollout_rules")
# Client modules whose every import is the standard library or another module of this list: the server's
# dependency on them pulls in nothing of the client's machinery (no httpx, no pydantic).
STANDARD_LIBRARY_ONLY = (PROTOCOL, *SIMULATOR_RULES)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_service_imports_only_the_clients_protocol_and_the_simulator_its_rules() -> None:
    graph = _graph()
    offending = {}
    for module, targets in graph.items():
        if not module.startswith("samrollout."):
            continue
        allowed = (PROTOCOL, *SIMULATOR_RULES) if _within(module, "samrollout.sim") else (PROTOCOL,)
        bad = sorted(t for t in targets if t.split(".")[0] == "samrollout_client"
                     and not any(_within(t, a) for a in allowed))
        if bad:
            offending[module] = bad
    assert not offending


def test_the_protocol_and_the_rules_import_only_the_standard_library_and_each_other() -> None:
    import sys

    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            module = _module_name(package, root, path)
            if not any(_within(module, allowed) for allowed in STANDARD_LIBRARY_ONLY):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                for name in names:
                    top = name.split(".")[0]
                    assert (top in sys.stdlib_module_names or top == "__future__"
                            or any(_within(name, allowed) for allowed in STANDARD_LIBRARY_ONLY)), (module, name)


def test_the_partial_rollout_and_the_simulator_share_one_set_of_rules() -> None:
    """The client's partial rollout and the simulator's import one rules module, and neither writes its own
    staleness default."""
    graph = _graph()
    assert "samrollout_client.rollout_rules" in graph["samrollout_client.rollouts.partial"]
    assert "samrollout_client.rollout_rules" in graph["samrollout.sim.rl_loop"]
    client, service = PACKAGES["samrollout_client"], PACKAGES["samrollout"]
    for path in (client / "rollouts" / "partial.py", service / "sim" / "rl_loop.py"):
        assert "DEFAULT_MAX_STALENESS =" not in path.read_text()


SERVER = PACKAGES["samrollout"] / "server"
BASE_MODULES = ("errors", "settings")


def _constant(init: Path, name: str) -> tuple[str, ...]:
    """A tuple of strings assigned to ``name`` in ``init`` (read, not imported)."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                value = ast.literal_eval(node.value)  # type: ignore[arg-type]
                return tuple(value)
    raise AssertionError(f"{init} does not set {name}")


def _server_part(module: str) -> str | None:
    """The part of the server ``module`` belongs to: its subpackage, `errors`/`settings`, or "" (the top)."""
    if not _within(module, "samrollout.server"):
        return None
    rest = module.removeprefix("samrollout.server").lstrip(".")
    head = rest.split(".")[0]
    if (SERVER / head).is_dir() or head in BASE_MODULES:
        return head
    return ""


def test_each_part_of_the_server_imports_only_the_parts_its_package_allows() -> None:
    allowed = {part.name: _constant(part / "__init__.py", "MAY_IMPORT")
               for part in SERVER.iterdir() if (part / "__init__.py").is_file()}
    allowed[""] = _constant(SERVER / "__init__.py", "MAY_IMPORT")
    for base in BASE_MODULES:
        allowed[base] = _constant(SERVER / "__init__.py", "BASE_MAY_IMPORT")
    offending = {}
    for module, targets in _graph().items():
        part = _server_part(module)
        if part is None:
            continue
        bad = sorted(t for t in targets if (target := _server_part(t)) not in (None, "", part)
                     and target not in allowed[part])
        bad += sorted(t for t in targets if _server_part(t) == "" and part != "" and t != "samrollout.server")
        if bad:
            offending[module] = bad
    assert not offending


def test_no_package_folder_holds_more_than_twelve_modules() -> None:
    """Folders that show the parts: a package past 12 modules is split by concern (its __init__ says how)."""
    crowded = {}
    for root in PACKAGES.values():
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir() and (p / "__init__.py").is_file())]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > 12:
                crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert not crowded


def test_no_route_module_imports_another() -> None:
    graph = _graph()
    routes = {m for m in graph if m.startswith("samrollout.server.") and m.endswith("_routes")}
    assert not {m: sorted(graph[m] & routes) for m in routes if graph[m] & routes}


def test_no_function_in_the_service_the_client_or_bench_is_over_sixty_lines() -> None:
    """Small functions with one job each: any over 60 lines is split (a helper, a table, a smaller class)."""
    long = {}
    for folder in (*PACKAGES.values(), ROOT / "bench"):
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > 60:
                        long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not long
