"""Every registered objective and every advantage estimator, two RL steps each through
the real stages: one rollout server and one reward server for the module (started as
`moerl train` starts them), and per run the trainer stage (`moerl trainer`) with the
Megatron policy, configured only by its overrides.

The model is fresh (no SFT), so the reward is a plug-in that random text scores
anywhere in [0, 1] (tests/integration/text_rewards.py): every group has a spread and
every objective has advantages to act on. Each run also sets one of its objective's
own arguments (`+rl.objective_args.*`) and checks its trace in the update's metrics, so
the arguments are seen to reach the loss from the run config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from local_servers import started
from text_rewards import PLUGIN, letter_prompts

from moerl.models.arch import TINY
from moerl.rl.config import AdvantageKind
from moerl.rl.objective_config import OBJECTIVE_NAMES

HERE = Path(__file__).parent
COMMON = [
    "sft.steps=0", "checkpoint.dir=null", "logger.wandb_mode=disabled", "logger.plot=false",
    "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=4", "rl.max_generation_rounds=1",
    "rl.dynamic_sampling=false", "rl.eval_interval=0", "rl.sampling.max_tokens=8",
    "data.source=jsonl", f"+rewards.plugins.{PLUGIN}",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    objective: str
    advantage: AdvantageKind
    overrides: tuple[str, ...]
    present: tuple[str, ...]  # train/<key> every step logs
    absent: tuple[str, ...] = ()  # train/<key> no step logs


# Each objective once, each advantage estimator at least once; one objective argument
# (or its default) seen acting in each.
CASES = [
    Case("ppo_clip", "gae", ("+rl.objective_args.kl_coef=0.02",),
         ("clip_frac", "kl_loss", "value_loss", "explained_variance")),
    Case("grpo", "grpo", ("+rl.objective_args.is_correction.mode=tis",),
         ("clip_frac", "kl_loss", "is/weight_mean")),  # GRPO's own kl_coef: 0.04
    Case("dr_grpo", "grpo_no_std", (), ("clip_frac",), ("kl_loss", "is/weight_mean")),
    Case("dapo", "rloo", ("+rl.objective_args.kl_coef=0.02",), ("clip_frac_high", "kl_loss")),
    Case("gspo", "reinforce_pp", ("rl.kl_in_reward=0.05",),
         ("seq_ratio_mean", "kl_in_reward"), ("kl_loss",)),
    Case("cispo", "grpo", ("+rl.objective_args.is_correction.mode=mis",),
         ("cispo_weight_mean", "is/dropped_frac"), ("kl_loss",)),
]


def test_the_cases_cover_every_objective_and_estimator() -> None:
    assert sorted(c.objective for c in CASES) == sorted(OBJECTIVE_NAMES)
    assert {c.advantage for c in CASES} == {"grpo", "grpo_no_std", "rloo", "reinforce_pp", "gae"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(rendezvous dir the servers announced in, prompts file)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    root = tmp_path_factory.mktemp("objectives")
    rendezvous, arch = root / "rendezvous", root / "arch.json"
    rendezvous.mkdir()
    arch.write_text(json.dumps(dataclasses.asdict(TINY)))
    prompts = letter_prompts(root / "prompts.jsonl")
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    reward = [sys.executable, "-m", "moerl.rewards.server", "--host", "127.0.0.1", "--port", "0",
              "--rendezvous-dir", str(rendezvous), "--reward", PLUGIN, "--max-concurrency", "2"]
    rollout = [sys.executable, "-m", "moerl.rollout.server", "--host", "127.0.0.1", "--port",
               "0", "--rendezvous-dir", str(rendezvous), "--arch-file", str(arch),
               "--max-batch", "8"]
    with started(reward, rendezvous, "reward", env), started(rollout, rendezvous, "rollout"):
        yield rendezvous, prompts


def _train(case: Case, rendezvous: Path, prompts: Path, run: Path) -> list[dict[str, Any]]:
    overrides = [*COMMON, f"data.path={prompts}", f"run_dir={run}",
                 f"rl.objective={case.objective}", f"rl.advantage={case.advantage}",
                 *case.overrides]
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.launchers.cli", "trainer", *overrides],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MOERL_RENDEZVOUS_DIR": str(rendezvous)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "weights/version" in r]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.objective}-{c.advantage}")
def test_two_rl_steps(case: Case, servers: tuple[Path, Path], tmp_path: Path) -> None:
    steps = _train(case, *servers, tmp_path / "run")
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        # Rewards spread within groups: the objective had advantages to act on.
        assert 0.0 < r["reward/mean"] < 1.0 and r["rollout/informative_groups"] > 0, r
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0, r
        for key in case.present:
            assert math.isfinite(r[f"train/{key}"]), (key, r)
        for key in case.absent:
            assert f"train/{key}" not in r, (key, r)
