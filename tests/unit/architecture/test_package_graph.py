"""Neither the subpackages of `moerl` nor its files form an import cycle
(docs/architecture.md, "Layers"); deferred and type-checking imports count."""

from __future__ import annotations

from pathlib import Path

from package_graph import find_cycle, imported_modules, module_graph, package_graph


def test_no_cycle_between_subpackages() -> None:
    graph = package_graph()
    assert {"rl", "rollout", "rewards", "sandbox", "agent", "launchers"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle or [])


def test_no_cycle_between_files() -> None:
    graph = module_graph()
    assert {"moerl.rl.loop", "moerl.rollout.ranks", "moerl.data.prompts"} <= set(graph)
    assert "moerl.rl.batch" in graph["moerl.rl.loop"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between files: " + " -> ".join(cycle or [])


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


def test_a_type_checking_import_closes_a_file_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "top"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("from top.y import g\n")
    (pkg / "y.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from top import x\n")
    (pkg / "z.py").write_text("from top import x, y\n")
    graph = module_graph(tmp_path, "top")
    assert graph["top.z"] == {"top.x", "top.y"}
    assert find_cycle(graph) in (["top.x", "top.y", "top.x"], ["top.y", "top.x", "top.y"])
    (pkg / "y.py").write_text("def g() -> None: ...\n")
    assert find_cycle(module_graph(tmp_path, "top")) is None
