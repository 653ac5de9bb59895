"""The subpackages of `moerl` form no import cycle (docs/architecture.md, "Layers")."""

from __future__ import annotations

from pathlib import Path

from package_graph import find_cycle, imported_modules, package_graph


def test_no_cycle_between_subpackages() -> None:
    graph = package_graph()
    assert {"rl", "rollout", "rewards", "sandbox", "agent", "launchers"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle or [])


def test_servers_sit_below_the_algorithm() -> None:
    graph = package_graph()
    for server_side in ("rollout", "rewards", "sandbox", "agent"):
        assert "rl" not in graph[server_side], server_side
        assert "trainer" not in graph[server_side], server_side


def test_a_lazy_import_closes_a_cycle(tmp_path: Path) -> None:
    # The graph reads imports inside functions too: a lazy import is a dependency.
    pkg = tmp_path / "top"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from top.b.y import f\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from ..a import x\n    return x\n")
    assert set(imported_modules(pkg / "b" / "y.py", tmp_path)) >= {"top.a", "top.a.x"}
    graph = package_graph(tmp_path, "top")
    assert graph == {"a": {"b"}, "b": {"a"}}
    assert find_cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])
