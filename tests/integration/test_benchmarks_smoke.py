"""Every script in benchmarks/ runs end to end in its smoke mode (`--smoke`: smallest
sizes, one repetition) and prints its result table, so a benchmark that no longer
starts fails here. The figures it prints are not checked: they vary with the machine.

A benchmark declares, as module-level literals read without importing it (importing
would load torch and Megatron into the test process):
    TABLE_TITLE        text printed on the line that starts its result table (required)
    NEEDS_EXECUTABLES  programs it cannot run without, e.g. ("bwrap",) (optional)
    NEEDS_MODULES      Python modules of an optional extra it cannot run without, e.g.
                       ("trl",) (optional): skipped when this test's interpreter cannot
                       find them (importlib.util.find_spec)
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
# Far above a smoke run (well under a minute each); a loaded machine may be slow.
TIMEOUT_S = 600
# Executables whose absence is already a test category of its own.
MARKS = {"bwrap": pytest.mark.sandbox}


def constants(script: Path) -> dict[str, Any]:
    """The module-level assignments of `script` whose values are literals."""
    found: dict[str, Any] = {}
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue  # computed values say nothing about the contract
    return found


def needs(script: Path) -> tuple[str, ...]:
    return tuple(constants(script).get("NEEDS_EXECUTABLES", ()))


def needs_modules(script: Path) -> tuple[str, ...]:
    return tuple(constants(script).get("NEEDS_MODULES", ()))


def benchmark_params() -> list[Any]:
    return [pytest.param(script, id=script.stem,
                         marks=[MARKS[exe] for exe in needs(script) if exe in MARKS])
            for script in BENCHMARKS]


def run_smoke(script: Path) -> subprocess.CompletedProcess[str]:
    """`script --smoke` in its own session, so a timeout also ends the processes it
    started (torchrun ranks, servers)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    argv = [sys.executable, str(script), "--smoke"]
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{script.name} --smoke ran over {TIMEOUT_S} s:\n{_tail(out, err)}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _tail(out: str, err: str, lines: int = 40) -> str:
    return "\n".join((out + err).splitlines()[-lines:])


def test_benchmarks_are_found() -> None:
    assert BENCHMARKS, f"no benchmarks in {ROOT / 'benchmarks'}"


@pytest.mark.parametrize("script", benchmark_params())
def test_benchmark_runs_in_smoke_mode(script: Path) -> None:
    title = constants(script).get("TABLE_TITLE")
    assert isinstance(title, str) and title, \
        f"{script.name}: set TABLE_TITLE to the text its result table starts with"
    missing = [exe for exe in needs(script) if shutil.which(exe) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")
    absent = [name for name in needs_modules(script) if importlib.util.find_spec(name) is None]
    if absent:
        pytest.skip(f"Python module {', '.join(absent)} not installed (an optional extra)")
    proc = run_smoke(script)
    assert proc.returncode == 0, f"{script.name} --smoke failed:\n{_tail(proc.stdout, proc.stderr)}"
    lines = proc.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if title in line]
    assert starts, f"{script.name} printed no '{title}' table:\n{proc.stdout[-3000:]}"
    assert any(line.strip() for line in lines[starts[-1] + 1:]), \
        f"{script.name}'s table has no rows:\n{proc.stdout[-3000:]}"
