"""nemo-run experiments from a RunPlan start the job our own launchers start.

Expectations come from `slurm.render_sbatch` (our sbatch script), parsed here, and
are compared with what nemo-run renders in a dry run (offline, local tunnel).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moerl.launchers import nemo, slurm
from moerl.launchers.cluster import slurm_config, with_cluster_ports
from moerl.launchers.stages import RunPlan, StageSpec

run = pytest.importorskip("nemo_run")

SHARED = Path("/shared/moerl")


def _demo_job() -> tuple[RunPlan, slurm.SlurmConfig]:
    from moerl.config import load_run_config
    from moerl.launchers.plan import build_run_plan
    from moerl.launchers.slurm_run import slurm_job

    overrides = ["+experiment=demo", "launcher=slurm", "cluster=h100",
                 f"launcher.python={SHARED}/.venv/bin/python"]
    cfg = load_run_config(overrides)
    root = SHARED / "runs" / "demo"
    plan = build_run_plan(root, overrides, cfg.launcher, cfg.rollout, cfg.rewards,
                          root / "arch.json", config_dir=SHARED / "configs")
    return slurm_job(plan, cfg, root.name)


def _h100_job() -> tuple[RunPlan, slurm.SlurmConfig]:
    from moerl.launchers import recipes

    recipe = recipes.load_recipe(recipes.REPO / "configs" / "experiment" / "kimi_k2_h100.yaml")
    run_dir = SHARED / "runs" / "kimi_k2"
    cluster = recipes.h100_cluster()
    plan = with_cluster_ports(recipes.run_plan(recipe, run_dir), cluster)
    return plan, slurm_config(cluster, "kimi_k2", 1800, str(SHARED / ".venv/bin/python"))


@pytest.fixture(scope="module", params=["demo", "kimi_k2_h100"])
def job(request: pytest.FixtureRequest) -> tuple[RunPlan, slurm.SlurmConfig]:
    return _demo_job() if request.param == "demo" else _h100_job()


def _ours(plan: RunPlan, cfg: slurm.SlurmConfig) -> dict[str, dict[str, object]]:
    """Per stage, from our sbatch script: header options and the srun line's argv."""
    text = slurm.render_sbatch(plan, cfg)
    groups: dict[int, str] = {}
    out: dict[str, dict[str, object]] = {}
    current = ""
    for line in text.splitlines():
        if m := re.match(r"# het group (\d+): (\w+)$", line):
            groups[int(m[1])], current = m[2], m[2]
            out[current] = {"header": {}}
        elif current and (m := re.match(r"#SBATCH --([\w-]+)=(\S+)$", line)):
            out[current]["header"][m[1]] = m[2]  # type: ignore[index]
        elif not line.startswith("#"):
            current = ""
    for m in re.finditer(r"srun --het-group=(\d+) (.*?) \\\n    (.*) &\n", text):
        out[groups[int(m[1])]]["argv"] = shlex.split(m[3])
    return out


def _dryrun(exp: object) -> tuple[str, dict[str, str]]:
    """nemo-run's sbatch script and the stage scripts it wrote, by file name."""
    # nemo-run's shell commands (invoke) read stdin, which pytest does not allow.
    with pytest.MonkeyPatch.context() as mp, open(os.devnull) as devnull:
        mp.setattr(sys, "stdin", devnull)
        exp.dryrun(log=False, delete_exp_dir=False)  # type: ignore[attr-defined]
    exp_dir = Path(exp._exp_dir)  # type: ignore[attr-defined]
    [sbatch] = exp_dir.rglob("*_sbatch.sh")
    return sbatch.read_text(), {p.name: p.read_text() for p in exp_dir.rglob("scripts/*.sh")}


def _nemo_groups(script: str) -> list[dict[str, str]]:
    header = script.split("\nset -evx")[0]
    return [dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", part))
            for part in header.split("#SBATCH hetjob")]


@pytest.fixture(scope="module")
def rendered(job: tuple[RunPlan, slurm.SlurmConfig], tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[str, dict[str, str]]:
    plan, cfg = job
    base = tmp_path_factory.mktemp("nemo")
    return _dryrun(nemo.experiment(plan, cfg, base_dir=str(base)))


def test_het_groups_match_plan(job: tuple[RunPlan, slurm.SlurmConfig],
                               rendered: tuple[str, dict[str, str]]) -> None:
    plan, cfg = job
    ours = _ours(plan, cfg)
    executor = nemo.slurm_executor(plan, cfg)
    assert executor.heterogeneous and len(executor.resource_group) == len(plan.stages) >= 3
    groups = _nemo_groups(rendered[0])
    srun_lines = re.findall(r"^srun --het-group=(\d+) (.*)$", rendered[0], re.M)
    for i, stage in enumerate(nemo.nemo_stages(plan)):
        header: dict[str, str] = ours[stage.name]["header"]  # type: ignore[assignment]
        request = executor.resource_group[i]
        assert request.nodes == stage.nodes == int(header["nodes"])
        assert groups[i]["nodes"] == header["nodes"]
        assert groups[i].get("gpus-per-node", "0") == header.get("gpus-per-node", "0")
        assert (request.gpus_per_node or 0) == stage.gpus_per_node
        # tasks: our header's count fits the group, and the step asks for exactly ours
        tasks = int(header.get("ntasks", 0)) or stage.nodes * int(header["ntasks-per-node"])
        assert stage.nodes * int(groups[i]["ntasks-per-node"]) >= tasks
        assert srun_lines[i][0] == str(i)
        step_opts = srun_lines[i][1].split()
        for key in ("nodes", "ntasks", "ntasks-per-node", "cpus-per-task", "gpus-per-node"):
            if key in header:
                assert f"--{key}={header[key]}" in step_opts, (stage.name, key)
        assert "--overlap" in step_opts


def test_job_settings_match_our_header(job: tuple[RunPlan, slurm.SlurmConfig],
                                       rendered: tuple[str, dict[str, str]]) -> None:
    plan, cfg = job
    trainer: dict[str, str] = _ours(plan, cfg)["trainer"]["header"]  # type: ignore[assignment]
    ours_text = slurm.render_sbatch(plan, cfg)
    for group in _nemo_groups(rendered[0]):
        for key in ("time", "partition", "account", "mem-per-cpu"):
            assert group.get(key) == trainer.get(key), key
        assert group["signal"] == trainer["signal"].removeprefix("B:")
    assert "#SBATCH --requeue" in ours_text
    assert rendered[0].count("#SBATCH --requeue") == len(plan.stages)
    port = cfg.cluster.master_port
    assert f"export MASTER_PORT=$(({port} + ${{SLURM_RESTART_COUNT:-0}}))" in rendered[0]
    trainer_group = [s.name for s in nemo.nemo_stages(plan)].index("trainer")
    assert f"SLURM_JOB_NODELIST_HET_GROUP_{trainer_group}" in rendered[0]


def test_stage_commands_are_our_srun_argv(job: tuple[RunPlan, slurm.SlurmConfig],
                                          rendered: tuple[str, dict[str, str]]) -> None:
    plan, cfg = job
    ours = _ours(plan, cfg)
    script, files = rendered
    steps = dict(re.findall(r"^srun --het-group=(\d+) .* (bash \S+) & pids\[\d+\]=\$!$",
                            script, re.M))
    assert len(steps) == len(plan.stages)
    for i, stage in enumerate(nemo.nemo_stages(plan)):
        entrypoint, flag, inner = ours[stage.name]["argv"]  # type: ignore[misc]
        assert (entrypoint, flag) == ("bash", "-c")
        runs, path = steps[str(i)].split()
        assert runs == entrypoint
        body = files[Path(path).name].removeprefix("#!/usr/bin/bash\n")
        if stage.name == "trainer":  # after the wait for the servers' announcements
            assert body.splitlines()[-1] == inner
            assert all(f"/{s.name}\"" in body for s in plan.servers)
        else:
            assert body == inner


def test_rendered_sbatch_has_one_srun_per_stage(
    job: tuple[RunPlan, slurm.SlurmConfig], rendered: tuple[str, dict[str, str]]
) -> None:
    plan, _ = job
    groups = re.findall(r"^srun --het-group=(\d+) ", rendered[0], re.M)
    assert sorted(groups) == [str(i) for i in range(len(plan.stages))]
    assert len(_nemo_groups(rendered[0])) == len(plan.stages)
    subprocess.run(["bash", "-n"], input=rendered[0], text=True, check=True)


def test_local_experiment_runs_the_plan(tmp_path: Path) -> None:
    """The local executor path, run for real: a server announces, the trainer sees it."""
    # Servers stay up until the trainer is done, as real ones do: nemo-run stops the
    # other jobs soon after the first one ends.
    server = ("import os, sys, time; from moerl.rendezvous import announce_from_env; "
              "announce_from_env(os.environ['MOERL_HOST'], int(sys.argv[1])); "
              "deadline = time.monotonic() + 120\n"
              "while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline: "
              "time.sleep(0.1)")
    trainer = ("import os, sys; from moerl.rendezvous import read_endpoints; "
               "open(sys.argv[1], 'w').write(' '.join(read_endpoints("
               "os.environ['MOERL_RENDEZVOUS_DIR'], 'reward')) + os.environ['X'])")
    out = tmp_path / "seen"
    plan = RunPlan(
        (StageSpec("trainer", (sys.executable, "-c", trainer, str(out)), torchrun=False,
                   env={"X": " ok"}),
         StageSpec("reward", (sys.executable, "-c", server, "{port}", str(out)), replicas=2,
                   port_base=9100)),
        tmp_path / "rdv", tmp_path / "logs")
    exp = nemo.experiment(plan, base_dir=str(tmp_path / "nemo"), startup_timeout=60)
    assert [type(e).__name__ for e in exp.jobs[0].executors] == ["LocalExecutor"] * 2
    with exp, pytest.MonkeyPatch.context() as mp, open(os.devnull) as devnull:
        mp.setattr(sys, "stdin", devnull)
        exp.run(sequential=False)
    logs = "\n".join(f"{p}:\n{p.read_text()}" for p in (tmp_path / "nemo").rglob("*.log"))
    assert out.exists(), logs
    assert out.read_text() == "127.0.0.1:9100 127.0.0.1:9101 ok"


def test_missing_nemo_run_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nemo_run", None)
    with pytest.raises(ImportError, match=r"moerl\[launch\]"):
        nemo.import_nemo_run()
