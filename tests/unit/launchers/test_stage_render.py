"""One stage description rendered three ways: the three agree on each replica.

The plan (a trainer under torchrun, two reward replicas, two rollout replicas of two
ranks each, every stage with env of its own and servers on fixed ports) is rendered
as the local launcher's argv and env, as the SLURM batch script's job steps, and as
nemo-run's stage scripts (local and SLURM). Shell text is evaluated by bash with
`exec` replaced by a dump of its argv and environment, so no stage process starts.
Each rendering gives, per (stage, index): the command after any torchrun, torchrun's
ranks per node, the placement and stage variables, and the port.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

from moerl.launchers import nemo, slurm
from moerl.launchers.local import LocalLauncher
from moerl.launchers.stage_render import fixed_port
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.rendezvous import ENV_HOST, ENV_INDEX, ENV_PORT, ENV_RENDEZVOUS, ENV_STAGE

run = pytest.importorskip("nemo_run")

HOST = "10.1.2.3"
# bash with the outside world stubbed: exec dumps what it would run and with what
# environment; hostname and scontrol answer as a node of the job would.
_PRELUDE = (
    "exec() { printf '%s\\0' \"$#\" \"$@\"; "
    "for v in $(compgen -e); do printf '%s\\0' \"$v=${!v}\"; done; }\n"
    f"hostname() {{ echo {HOST}; }}\n"
    f"scontrol() {{ printf '{HOST}\\n{HOST}\\n'; }}\n"
)
_VARS = (ENV_STAGE, ENV_INDEX, ENV_HOST, ENV_PORT)

Replica = tuple[str, int]


class Launch(NamedTuple):
    """One replica as a renderer starts it."""

    argv: list[str]
    """the command after any torchrun."""
    nproc: int | None
    """torchrun's ranks per node; None without torchrun."""
    port: int
    env: dict[str, str | None]
    """the placement variables and every stage's env variables (None: not set)."""


def _plan(tmp: Path) -> RunPlan:
    return RunPlan(
        (
            StageSpec("trainer", ("python", "-m", "train", "--note", "a b", "{host}"),
                      ranks_per_node=4, env={"OMP_NUM_THREADS": "1", "TRAIN_X": "t"}),
            StageSpec("reward", ("serve-reward", "--bind={host}:{port}", "--id", "r{index}"),
                      replicas=2, nodes=2, port_base=9100, env={"REWARD_Y": "it's"}),
            StageSpec("rollout", ("serve-rollout", "--port", "{port}", "--host", "{host}"),
                      replicas=2, nodes=2, ranks_per_node=2, port_base=9000,
                      env={"ROLLOUT_Z": "z z"}),
        ),
        tmp / "rdv", tmp / "logs",
    )


def _stage_vars(plan: RunPlan) -> set[str]:
    return {k for s in plan.stages for k in s.env} | set(_VARS)


def _launch(plan: RunPlan, argv: list[str], env: dict[str, str]) -> Launch:
    """What one replica runs, without the launcher's wrapping: torchrun's ranks per node
    (None: no torchrun) and the command after `--no-python`."""
    nproc = None
    if "--no-python" in argv:
        nproc = next(int(a.split("=")[1]) for a in argv if a.startswith("--nproc-per-node="))
        argv = argv[argv.index("--no-python") + 1:]
    return Launch(argv, nproc, int(env[ENV_PORT]),
                  {k: env.get(k) for k in sorted(_stage_vars(plan))})


def _bash(script: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment `exec` gets when bash runs `script`."""
    base = {"PATH": os.environ["PATH"], **env}
    out = subprocess.run(["bash", "-c", _PRELUDE + script], env=base, capture_output=True,
                         check=True).stdout.decode().split("\0")
    count = int(out[0])
    entries = [e.split("=", 1) for e in out[1 + count:] if "=" in e]
    return out[1:1 + count], dict(entries)


def _local(plan: RunPlan) -> dict[Replica, Launch]:
    launcher = LocalLauncher(plan, host=HOST)
    out = {}
    for stage in plan.stages:
        for index, port in enumerate(launcher.replica_ports(stage)):
            env = launcher.replica_env(stage, index, port)
            assert env[ENV_RENDEZVOUS] == str(plan.rendezvous_dir)
            argv = launcher.replica_command(stage, index, port)
            out[stage.name, index] = _launch(plan, argv, env)
    return out


def _slurm_steps(plan: RunPlan) -> dict[str, tuple[list[str], str]]:
    """Per stage, the srun options and the `bash -c` body of its job step."""
    text = slurm.render_sbatch(plan, slurm.SlurmConfig())
    steps = {}
    for m in re.finditer(r"^srun (.*?) \\\n    (.*) &$", text, re.M):
        [stage] = re.findall(r'--output="\$LOG_DIR/(\w+)-', m[1])
        entrypoint, flag, body = shlex.split(m[2])
        assert (entrypoint, flag) == ("bash", "-c")
        steps[stage] = (m[1].split(), body)
    rdv = re.search(rf"^export {ENV_RENDEZVOUS}=(\S+)/\$SLURM_JOB_ID$", text, re.M)
    assert rdv is not None and rdv[1] == shlex.quote(str(plan.rendezvous_dir))
    return steps


def _tasks(opts: list[str]) -> int:
    values = dict(o.removeprefix("--").split("=", 1) for o in opts if "=" in o)
    if "ntasks" in values:
        return int(values["ntasks"])
    return int(values["nodes"]) * int(values["ntasks-per-node"])


def _evaluate_steps(plan: RunPlan, steps: dict[str, tuple[list[str], str]]
                    ) -> dict[Replica, Launch]:
    """Each task of each step, as SLURM would start it (task i on node i)."""
    out = {}
    for name, (opts, body) in steps.items():
        for task in range(_tasks(opts)):
            argv, env = _bash(body, {"SLURM_PROCID": str(task), "SLURM_NODEID": str(task),
                                     "MOERL_ADVERTISE_HOST": HOST})
            out[name, int(env[ENV_INDEX])] = _launch(plan, argv, env)
    return out


def _nemo_slurm(plan: RunPlan) -> dict[str, tuple[list[str], str]]:
    """nemo-run's SLURM scripts with the srun options of their executors."""
    cfg = slurm.SlurmConfig()
    steps = {}
    for stage, script, executor in zip(nemo.nemo_stages(plan), nemo.slurm_scripts(plan, cfg),
                                       nemo.slurm_executors(plan, cfg), strict=True):
        assert script.entrypoint == "bash"
        # the trainer's script first waits for the servers; its last line is the step
        steps[stage.name] = (executor.srun_args, script.inline.splitlines()[-1])
    return steps


def _nemo_local(plan: RunPlan) -> dict[Replica, Launch]:
    out = {}
    for stage, script in zip(nemo.nemo_stages(plan), nemo.local_scripts(plan, host=HOST),
                             strict=True):
        assert Path(script.env[ENV_RENDEZVOUS]).parent == plan.rendezvous_dir
        lines = [line for line in script.inline.splitlines() if line.startswith("(export ")]
        assert len(lines) == stage.replicas
        for line in lines:
            argv, env = _bash(line.removeprefix("(").removesuffix(") &"), dict(script.env))
            out[stage.name, int(env[ENV_INDEX])] = _launch(plan, argv, env)
    return out


def _renderings(plan: RunPlan) -> dict[str, dict[Replica, Launch]]:
    return {
        "local": _local(plan),
        "slurm": _evaluate_steps(plan, _slurm_steps(plan)),
        "nemo-slurm": _evaluate_steps(plan, _nemo_slurm(plan)),
        "nemo-local": _nemo_local(plan),
    }


def test_local_slurm_and_nemo_start_the_same_replicas(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    rendered = _renderings(plan)
    local = rendered["local"]
    for name, replicas in rendered.items():
        assert replicas == local, name
    # and what they agree on is the plan
    for stage in plan.stages:
        for index in range(stage.replicas):
            port = stage.port_base + index if stage.is_server else 0
            got = local[stage.name, index]
            assert got.port == port
            assert got.argv == stage.argv(HOST, port, index)
            assert got.nproc == (stage.ranks_per_node if stage.name == "trainer"
                                 or stage.server_torchrun else None)
            env = {k: v for k, v in got.env.items() if v is not None}
            assert env == {**stage.env, ENV_STAGE: stage.name, ENV_INDEX: str(index),
                           ENV_HOST: HOST, ENV_PORT: str(port)}
    assert sorted(local) == sorted((s.name, i) for s in plan.stages for i in range(s.replicas))


def test_a_renderer_that_drops_stage_env_or_moves_a_port_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tmp_path)
    local = _local(plan)
    steps = _slurm_steps(plan)
    opts, body = steps["reward"]
    steps["reward"] = (opts, body.replace("export REWARD_Y=", "export OTHER="))
    assert _evaluate_steps(plan, steps) != local
    steps = _slurm_steps(plan)
    opts, body = steps["rollout"]
    steps["rollout"] = (opts, body.replace("9000 +", "9001 +"))
    assert _evaluate_steps(plan, steps) != local
    # nemo-run's local scripts on ports one further along
    monkeypatch.setattr(nemo, "fixed_port", lambda stage, index: str(
        int(fixed_port(stage, index)) + stage.is_server))
    assert _nemo_local(plan) != local
