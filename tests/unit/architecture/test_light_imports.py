"""What a process imports decides what it costs: servers on other nodes and the
launcher's quick commands must not pay for torch or Megatron."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from package_graph import SRC

_IMPORT_ONLY = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in ("torch", "megatron") if m in sys.modules)))
"""

# Runs the CLI in-process as `moerl ARGS`, then reports what was imported.
_CLI = """
import json, sys
sys.argv = ["moerl", *sys.argv[1:]]
from moerl.launchers.cli import main
try:
    code = main()
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "megatron")
                                                if m in sys.modules)}))
"""


def _child(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC), "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, cwd=SRC.parent, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["moerl.rewards.server", "moerl.sandbox", "moerl.config",
                                    "moerl.rendezvous", "moerl.rollout.client"])
def test_module_imports_no_torch(module: str) -> None:
    assert json.loads(_child(_IMPORT_ONLY, module)) == []


@pytest.mark.parametrize("args", [
    ["--help"],
    ["plan", "model=kimi-k2", "cluster.nodes=160"],
    ["train", "+experiment=demo", "--dry-run"],
    ["train", "launcher=slurm", "cluster=h100", "--dry-run"],
], ids=["help", "plan", "train-dry-run", "slurm-dry-run"])
def test_quick_commands_import_no_megatron(args: list[str], tmp_path: Path) -> None:
    if args[0] == "train":
        args = [*args, f"run_dir={tmp_path / 'run'}"]
    report = json.loads(_child(_CLI, *args))
    assert report["code"] == 0
    assert "megatron" not in report["heavy"], args


def test_local_dry_run_starts_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    report = json.loads(_child(_CLI, "train", "+experiment=demo", "--dry-run", f"run_dir={run}"))
    assert report["code"] == 0
    assert (run / "config.json").is_file()  # the checked config is written ...
    assert not (run / "logs").exists() and not (run / "rendezvous").exists()  # ... nothing ran
