"""The import graph of `src/moerl`, read from the source with `ast`.

Every `import` and `from ... import` counts, at module level or inside a function
(a lazy import is still a dependency), and so does one under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src"


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path) -> Iterator[tuple[str, list[str]]]:
    """Each import of `path` as (module, names taken from it): `import a.b` is
    ("a.b", []), `from .c import d` ("<package>.c", ["d"]) (relative imports resolved)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, [alias.name for alias in node.names]


def imported_modules(path: Path, root: Path = SRC) -> Iterator[str]:
    """Absolute names of what `path` imports: every module, and each `from` import's
    names as if they were modules."""
    for base, names in _imports(path, root):
        yield base
        yield from (f"{base}.{name}" for name in names)


def subpackage(module: str, top: str = "moerl") -> str | None:
    """`moerl.rl.loop` -> `rl`; `moerl.config` -> `config`; None outside `top`."""
    parts = module.split(".")
    if parts[0] != top or len(parts) < 2:
        return None
    return parts[1]


def package_graph(root: Path = SRC, top: str = "moerl") -> dict[str, set[str]]:
    """subpackage (or top-level module) -> the others it imports."""
    known = {p.stem if p.is_file() else p.name for p in (root / top).iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    graph: dict[str, set[str]] = {name: set() for name in known}
    for path in (root / top).rglob("*.py"):
        source = subpackage(module_name(path, root), top)
        if source is None:
            continue
        for target in map(lambda m: subpackage(m, top), imported_modules(path, root)):
            if target in known and target != source:
                graph[source].add(target)
    return graph


def module_graph(root: Path = SRC, top: str = "moerl") -> dict[str, set[str]]:
    """Every module (file) of `top` -> the modules of `top` it imports. `from a import b`
    counts as importing `a.b` when that is a module, else `a`."""
    paths = {module_name(path, root): path for path in (root / top).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for target in _imported_files(path, root):
            if target in paths and target != name:
                graph[name].add(target)
    return graph


def _imported_files(path: Path, root: Path) -> Iterator[str]:
    """As `imported_modules`, but `from a import b` yields only `a.b` when that is a
    file (the package `a` is then only the way to it, as for `import a.b`)."""
    for base, names in _imports(path, root):
        if not names:
            yield base
        for name in names:
            sub = root / Path(*base.split("."), name)
            is_file = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()
            yield f"{base}.{name}" if is_file else base


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None
