"""Checkpoints and resume of a real RL run (RELIABILITY.md cases 20-22).

`moerl train` of the tiny MoE with its real rollout and reward servers on
127.0.0.1, the trainer under torchrun (gloo): a short sync run with a 2-step SFT
warm-up, so the reference model (the policy after SFT) is not the initial one.
The data are twelve one-line tasks, `def f(): return i  # <completion>`: a
completion passes while it stays on the comment line, so the samples of a random
policy get different rewards and, with dynamic sampling (whose state is part of
what resumes; up to three rounds of generation a step), every RL step trains.

On CPU with one thread per process every stage is deterministic (rollouts are
seeded per step and sample), so a run killed after a checkpoint and resumed
must log exactly the uninterrupted run's metrics, timings aside.

Start-up copies no model: the reference model and the rollout servers' first version
are read where the weights are (the SFT output; on resume the checkpoint's model part),
so neither run writes a reference copy or a version of the weights before its first
step, which the tests count in bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_rl_data import comment_tasks

from moerl.rendezvous import REQUEUE_EXIT_CODE

STEPS = 4
RUN = [
    "+experiment=demo", "sft.steps=2", "sft.global_batch=8", "sft.micro_batch=4",
    "rl.prompts_per_step=2", "rl.group_size=4", "rl.sampling.max_tokens=48",
    "rl.dynamic_sampling=true", "rl.max_generation_rounds=3", "rl.eval_interval=2",
    "logger.wandb_mode=disabled", "logger.plot=false",
    "checkpoint.save_interval=2", "checkpoint.keep_last=0",
]  # fmt: skip

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return comment_tasks(tmp_path_factory.mktemp("data"))


def _argv(stage: str, run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moerl.launchers.cli", stage, *RUN, *extra, f"run_dir={run}"]


def _start(run: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    run.mkdir(parents=True, exist_ok=True)
    out = run.parent / f"{run.name}.{time.monotonic_ns()}.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(_argv("train", run, *extra), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, out


def _finish(proc: subprocess.Popen[bytes], out: Path, timeout: float = 400) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, out.read_text(errors="replace")


def _until(cond: Callable[[], bool], proc: subprocess.Popen[bytes], out: Path,
           what: str) -> None:
    deadline = time.monotonic() + 400
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            _finish(proc, out, timeout=30)
            pytest.fail(f"never saw {what}:\n{out.read_text(errors='replace')[-4000:]}")
        time.sleep(0.1)


def _trainer_rank(run: Path) -> int:
    """The pid of the trainer's rank (not torchrun): it carries the run's rendezvous."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"MOERL_RENDEZVOUS_DIR={run / 'rendezvous'}".encode() in environ
                and b"MOERL_STAGE=trainer" in environ and b"moerl.launchers.cli" in cmd
                and b"torch.distributed.run" not in cmd):
            return int(entry.name)
    raise AssertionError(f"no trainer rank of {run} is running")


def _latest(run: Path) -> str | None:
    path = run / "checkpoints" / "latest"
    return path.read_text().strip() if path.is_file() else None


def _rows(run: Path) -> list[dict[str, Any]]:
    """The logged metrics, timings aside (the only thing allowed to differ)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _startup_copies(run: Path, first_step: int) -> int:
    """Bytes of the model copies a start-up used to write: the reference model and the
    weight version the servers start from."""
    return (_bytes(run / "checkpoints" / "reference")
            + _bytes(run / "weights" / f"v{first_step:06d}"))


def _rl_state(run: Path, step: int) -> dict[str, Any]:
    state = json.loads((run / "checkpoints" / f"step_{step:08d}" / "state.json").read_text())
    rl: dict[str, Any] = state["extra"]["rl"]
    return rl


@pytest.fixture(scope="module")
def reference(data: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run."""
    run = tmp_path_factory.mktemp("reference") / "run"
    code, text = _finish(*_start(run, f"rl.steps={STEPS}", *data))
    assert code == 0, text[-4000:]
    assert "SFT: loss" in text
    steps = [r for r in _rows(run) if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(r["train/tokens"] > 0 and r["rollout/informative_groups"] > 0 for r in steps)
    assert _startup_copies(run, 0) == 0
    assert _rl_state(run, 2)["reference"] == {"weights": str((run / "sft").resolve())}
    return run


def test_sigkill_after_a_checkpoint_then_resume_is_exact(
        reference: Path, data: list[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc, out = _start(run, f"rl.steps={STEPS}", *data)
    # Killed in step 3, after its evaluation was logged: the resumed run logs it again.
    _until(lambda: _latest(run) == "step_00000002" and any(
        r["step"] == 2 and "eval/pass_rate" in r for r in _rows(run)), proc, out, "step 3")
    os.kill(_trainer_rank(run), signal.SIGKILL)
    code, text = _finish(proc, out)
    assert code not in (0, REQUEUE_EXIT_CODE), text[-3000:]
    assert _latest(run) == "step_00000002"

    assert _startup_copies(run, 0) == 0
    code, text = _finish(*_start(run, f"rl.steps={STEPS}", *data))  # the same command
    assert code == 0, text[-4000:]
    assert "resumed from" in text and "step_00000002" in text
    # What a start-up copy would have weighed: the model part of a checkpoint.
    assert _startup_copies(run, 2) == 0 < _bytes(run / "checkpoints" / "step_00000002" / "dist")
    assert "SFT: loss" not in text  # the checkpoint holds the policy after SFT
    assert _rows(run) == _rows(reference)  # losses, rewards, KL to the reference, evals
    for step in (2, STEPS):  # the same prompts were taken, in the same order
        assert _rl_state(run, step)["prompts"] == _rl_state(reference, step)["prompts"]
    assert _rl_state(run, STEPS)["next_step"] == STEPS


def test_sigterm_checkpoints_and_exits_for_requeue(data: list[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc, out = _start(run, "rl.steps=50", "checkpoint.save_interval=0", *data)
    _until(lambda: "RL step 1/50" in out.read_text(errors="replace"), proc, out, "RL step 1")
    os.kill(_trainer_rank(run), signal.SIGTERM)
    code, text = _finish(proc, out)
    assert code == REQUEUE_EXIT_CODE, text[-4000:]
    assert "stopping after this step: SIGTERM" in text and "(requeue)" in text
    done = [r["step"] for r in _rows(run) if "train/loss" in r]
    assert done and done == list(range(len(done)))  # the step in progress was finished
    assert _latest(run) == f"step_{len(done):08d}"
    assert _rl_state(run, len(done))["next_step"] == len(done)

    # Resuming it with another dataset or model is refused before anything trains.
    changed = [("data.eval_path=" + data[1].split("=", 1)[1], "different data"),
               ("model.num_layers=3", "different model")]
    for override, message in changed:
        argv = _argv("trainer", run, "rl.steps=50", *data, override)
        done_ = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done_.returncode == 1, done_.stderr[-3000:]
        assert "moerl trainer: checkpoint error:" in done_.stderr, done_.stderr[-3000:]
        assert message in done_.stderr and "refusing to resume" in done_.stderr
        field = message.split()[1]
        assert f"checkpoint.allow_changed_{field}=true" in done_.stderr
