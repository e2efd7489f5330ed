"""The package layout, checked: no import circles among kvrouter's modules, and docs/architecture.md's table
names every module and package that exists (and nothing that does not).

The import graph is read from the source with `ast`, so it sees every import: module level, function level
(lazy) and under `if TYPE_CHECKING:` alike — a circle hidden behind a lazy import is still a circle a newcomer
has to hold in their head.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvrouter"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def own_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "_vendor" not in path.parts}


def imported_names(path: Path, name: str) -> set[str]:
    """Every module name an import in `path` may refer to (`from a import b` names both a and a.b)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = own_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path, name):
            # `import kvrouter.a.b` also runs kvrouter.a's __init__; count the deepest own module named
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and imported != "kvrouter":
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One representative cycle per strongly connected component of more than one module (Tarjan)."""
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
    return [cycle_within(graph, component) for component in components]


def cycle_within(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    path = [start]
    seen = {start}
    node = start
    while True:
        succ = min(s for s in graph[node] if s in component)
        if succ in seen:
            return [*path[path.index(succ) :], succ]
        path.append(succ)
        seen.add(succ)
        node = succ


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_lazy_imports_are_seen(tmp_path: Path) -> None:
    source = tmp_path / "kvrouter" / "pkg" / "mod.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..other import thing\n"
        "if TYPE_CHECKING:\n    from kvrouter.typed import T\n"
        "def f():\n    import kvrouter.lazy\n"
    )
    names = imported_names(source, "kvrouter.pkg.mod")
    assert {"kvrouter.pkg.sibling", "kvrouter.other", "kvrouter.typed", "kvrouter.lazy"} <= names


def test_no_import_circles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def table_paths() -> list[str]:
    """The `kvrouter/...` paths named in docs/architecture.md's module table (first column)."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = lines.index("| module | job |")
    paths: list[str] = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        first_cell = line.split("|")[1]
        paths.extend(re.findall(r"`(kvrouter/[^`]*)`", first_cell))
    return paths


def layout_entries() -> set[str]:
    """Every public module and package under kvrouter/, as the table spells them."""
    entries: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if any(part.startswith("_") for part in relative.parts[1:-1]) or "_vendor" in relative.parts:
            continue
        if path.name == "__init__.py":
            if path.parent != PACKAGE:
                entries.add(f"{relative.parent.as_posix()}/")
        elif not path.name.startswith("_"):
            entries.add(relative.as_posix())
    return entries


def test_architecture_table_names_every_module() -> None:
    missing = sorted(layout_entries() - set(table_paths()))
    assert not missing, f"docs/architecture.md's table does not name: {', '.join(missing)}"


def test_architecture_table_names_only_what_exists() -> None:
    named = table_paths()
    assert len(named) == len(set(named)), "a path is named twice in docs/architecture.md's table"
    gone = [path for path in named if not (ROOT / path).exists()]
    assert not gone, f"docs/architecture.md's table names paths that do not exist: {', '.join(gone)}"
