"""Arrows point one way: no import cycle among the modules of gateway/ and tts_backend/, and none from a
folder to one it must not know (FOLDER_RULES: the store knows no session, audio/ knows nothing else of the
gateway, the protocol knows none of its users, ...).

Imports are read from the source with ast, wherever they are: at a module's top, inside a function (a
lazy import still makes a cycle, only a later one), and under `if TYPE_CHECKING:` too. A type-checking
import is counted because the cycle it hides is real for the reader and for the type checker, and the
way out is the same as for a runtime one: the shared part moves to a module both sides import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "tts_backend")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that module `name` (at `path`) imports anywhere in its source. `from X import
    Y` counts X.Y when that is a module, else X; a package's own __init__ is not an edge to its members."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            candidates = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                          for alias in node.names]
        else:
            continue
        for candidate in candidates:
            # `import a.b.c` (or a name inside a module) resolves to the longest known module prefix
            parts = candidate.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != name:
                found.add(".".join(parts))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [cycle_through(graph, component) for component in components]


def cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A path start -> ... -> start inside the component, for the failure message."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for succ in sorted(graph[node] & component):
            if succ == start:
                return paths[node] + [start]
            if succ not in paths:
                paths[succ] = paths[node] + [succ]
                frontier.append(succ)
    raise AssertionError(f"no cycle through {component}")


# (importer, imported, why not): no module in or under `importer` imports a module in or under `imported`.
# "gateway.audio" stands for gateway/audio/ and everything in it; "gateway" alone for all of the gateway.
FOLDER_RULES = (
    ("gateway.store", "gateway.session", "the store keeps sessions; the session uses the store, never the reverse"),
    ("gateway.store", "gateway.http", "the store knows no route that reads it"),
    ("gateway.store", "gateway.gateway", "the store is one of the app's parts, not the app"),
    ("gateway.session", "gateway.http", "the WebSocket session and the HTTP routes are siblings"),
    ("gateway.session", "gateway.gateway", "a session is handed its parts; it does not look up the app"),
    ("gateway.http.static", "gateway.http.routes", "static files know no API route"),
    ("gateway.protocol", "gateway.session", "the protocol's messages know none of their users"),
    ("gateway.protocol", "gateway.http", "the protocol's messages know none of their users"),
    ("gateway.protocol", "gateway.store", "the protocol's messages know none of their users"),
    ("tts_backend", "gateway", "the backends are the layer below the gateway"),
)
# (folder, why): modules in `folder` import nothing of the gateway outside it.
SELF_CONTAINED = (
    ("gateway.audio", "audio formats and decoding stand alone (untrusted media is decoded in a small process)"),
)


def within(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def folder_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that breaks FOLDER_RULES or SELF_CONTAINED, as 'importer -> imported: why'."""
    found = []
    for module, imports in sorted(graph.items()):
        for imported in sorted(imports):
            for importer_folder, imported_folder, why in FOLDER_RULES:
                if within(module, importer_folder) and within(imported, imported_folder):
                    found.append(f"{module} -> {imported}: {why}")
            for folder, why in SELF_CONTAINED:
                if within(module, folder) and within(imported, "gateway") and not within(imported, folder):
                    found.append(f"{module} -> {imported}: {why}")
    return found


def test_folders_import_one_way():
    violations = folder_violations(import_graph())
    assert not violations, "imports against the layout's arrows:\n" + "\n".join(violations)


def test_every_folder_rule_names_modules_that_exist():
    """A rule about a folder that was renamed away would pass for ever."""
    modules = set(project_modules())
    named = {f for rule in FOLDER_RULES for f in rule[:2]} | {folder for folder, _ in SELF_CONTAINED}
    assert sorted(f for f in named if not any(within(m, f) for m in modules)) == []


def test_the_folder_check_reports_each_kind_of_violation():
    graph = {
        "gateway.store.base": {"gateway.session.data"},  # store -> session
        "gateway.audio.pcm": {"gateway.settings", "gateway.audio.encoders"},  # audio -> the rest of the gateway
        "gateway.protocol": {"gateway.http.routes"},
        "tts_backend.base": {"gateway.protocol"},
        "gateway.session.connection": {"gateway.store.base", "gateway.protocol"},  # allowed arrows
        "gateway.http.routes": {"gateway.session.segmenter", "gateway.protocol"},
    }
    assert [v.split(":")[0] for v in folder_violations(graph)] == [
        "gateway.audio.pcm -> gateway.settings",
        "gateway.protocol -> gateway.http.routes",
        "gateway.store.base -> gateway.session.data",
        "tts_backend.base -> gateway.protocol",
    ]


def test_no_import_cycle_among_gateway_and_backend_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_checker_sees_top_level_function_level_and_type_checking_imports(tmp_path):
    """The checker itself: each kind of import closes a cycle it reports."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .c import thing\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n")
    names = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    graph = {name: imported_modules(name, package / f"{name.removeprefix('pkg.')}.py", names)
             for name in names - {"pkg"}}
    graph["pkg"] = set()
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    (package / "c.py").write_text("import pkg\n")
    graph["pkg.c"] = imported_modules("pkg.c", package / "c.py", names)
    assert find_cycles(graph) == []
