"""The import contracts of `make lint` (pyproject.toml, [tool.importlinter]) hold, and
one bad import in a copy of the source breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports on the tree at `root` (its pyproject.toml and src/)."""
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    shutil.copy(REPO / "pyproject.toml", root)
    shutil.copytree(REPO / "src" / "moerl", root / "src" / "moerl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_contracts_hold() -> None:
    done = _lint(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(("module", "bad_import", "contract"), [
    ("rewards/server.py", "import torch", "import no torch, Megatron or trainer code"),
    ("sandbox/runner.py", "from moerl.rl import loop", "import no torch, Megatron or trainer"),
    ("rollout/server.py", "from moerl.checkpoint import checkpointer",
     "The rollout server imports no RL, trainer or checkpoint code"),
    ("rl/loop.py", "from moerl.launchers import cli", "Nothing imports the launchers"),
    ("parallel/layout.py", "from moerl.planning import memory",
     "Models and parallel groups import no planning"),
    ("config.py", "import megatron.core", "The run config imports no torch or Megatron"),
    ("models/arch.py", "from moerl.data import tokenizer",
     "Stages stack from the launchers down to the base modules"),
    # Inside the packages: each closes one of the file cycles the layers broke.
    ("rl/agent_collect.py", "from moerl.rl import loop", "Inside rl:"),
    ("data/prompts.py", "from moerl.data import mixture", "Inside data:"),
    ("rollout/ranks.py", "from moerl.rollout import engine", "Inside rollout:"),
    ("sandbox/launch.py", "from moerl.sandbox import runner", "Inside sandbox:"),
])
def test_one_bad_import_breaks_a_contract(
    source_copy: Path, module: str, bad_import: str, contract: str
) -> None:
    path = source_copy / "src" / "moerl" / module
    original = path.read_text()
    # Appended inside a function: a lazy import counts like one at the top.
    path.write_text(original + f"\n\ndef _injected() -> None:\n    {bad_import}  # noqa\n")
    try:
        done = _lint(source_copy)
    finally:
        path.write_text(original)
    assert done.returncode != 0, done.stdout
    broken = [line for line in done.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(contract in line for line in broken), done.stdout
