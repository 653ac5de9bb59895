"""`rl.mode=async` through the real stages (reward server with the sandbox, rollout
server, trainer as local processes): the next step's samples are generated while the
current one trains, so trained samples are one weight version old, never more. The
policy update runs with full activation recompute (`recompute=full`).

The same run is PPO with a critic (`rl.advantage=gae`, one critic warm-up step, KL in
the reward): every step logs the value loss, the explained variance and the GAE
advantages, the policy moves from the second step on, and the checkpoint at the end
holds the critic beside the policy. The engine returns the experts it routed to and the
update replays them (`rl.routing_replay`). With partial rollouts a weight push lands
between two decode steps of the next step's generation; no sample is dropped.

A second run shows a generation spanning a weight update. The timing is arranged by
the sizes rather than left to chance. The next step's generation starts when the
update starts, and the new weights land when the update and its push end: the share of
the generation before them is about (update + push) / generation. Each generation is
512 tokens decoded one after another (rl.sampling.ignore_eos: no sample ends early);
each update two minibatch steps over four samples (no reference model, no critic) and
the push of a tiny model: a few forward and backward passes against 512 sequential
decode steps, so the weights land inside the generation, neither before its first
tokens (a one-pass update pushed before the generation had begun decoding) nor after
its last. The first update also pays one-time costs and may outlast its generation,
so the run has four steps: three generations overlap an update, and those spanning one
carry tokens of two versions, each with the rollout logprob of the version that
sampled it; the IS correction's metrics see both.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

sys.path.insert(0, str(Path(__file__).parent))
from text_rewards import PLUGIN, letter_prompts

STEPS = 4


def test_async_run_trains_one_version_stale_samples(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=demo", "sft.steps=0",
            f"run_dir={run}", "logger.wandb_mode=disabled",
            f"rl.steps={STEPS}", "rl.prompts_per_step=2", "rl.group_size=4",
            "rl.max_generation_rounds=1", "rl.dynamic_sampling=false", "rl.mode=async",
            "rl.max_staleness=1", "rl.eval_interval=0", "data.eval_size=2",
            "rl.sampling.max_tokens=8", "recompute=full",
            "rl.advantage=gae", "rl.critic.warmup_steps=1", "rl.kl_in_reward=0.05",
            "rl.updates_per_step=2", "rl.routing_replay=true",
            "rollout.partial_rollouts=true"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert not (run / "sft").exists()  # a fresh model: no SFT warm-up
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "weights/version" in r]
    assert [r["weights/version"] for r in steps] == [float(s + 1) for s in range(STEPS)]
    trained = [r["async/staleness_max_trained"] for r in steps]
    assert max(trained) == 1.0, trained  # the overlap happened: a batch of the old weights
    assert all(r["async/dropped_stale"] == 0 for r in steps)
    for r in steps:
        assert r["time/step"] > 0 and r["train/tokens"] > 0
        for key in ("value_loss", "explained_variance", "advantages_mean", "advantages_std",
                    "returns_mean", "values_mean", "critic_grad_norm", "kl_in_reward"):
            assert math.isfinite(r[f"train/{key}"]), (key, r)
        assert r["train/value_loss"] > 0 and r["train/advantages_std"] > 0
        assert r["rollout/routed_samples"] == 1.0  # the engine's routing, replayed
        assert r["async/masked_stale_tokens"] == 0  # one version old at most: all kept
    # Warm-up: the first step trains the critic alone, then the policy moves too.
    assert [r["train/critic_warmup"] for r in steps] == [1.0] + [0.0] * (STEPS - 1)
    assert "train/loss" not in steps[0] and all("train/loss" in r for r in steps[1:])
    assert steps[0]["train/values_mean"] == 0.0  # the head starts at zero
    assert any(r["train/values_mean"] != 0.0 for r in steps[1:])
    _check_the_critic_is_checkpointed(run / "checkpoints" / f"step_{STEPS:08d}")


def _check_the_critic_is_checkpointed(path: Path) -> None:
    state = json.loads((path / "state.json").read_text())
    assert state["parts"]["critic"]["optimizer"]["step"] == 2 * STEPS  # two minibatches a step
    assert state["extra"]["rl"]["updates"] == STEPS
    keys = FileSystemReader(str(path / "dist")).read_metadata().state_dict_metadata
    critic = [k for k in keys if k.startswith("critic.")]
    assert "critic.value_head.weight" in critic and "critic.output_layer.weight" not in keys
    # The critic's Adam moments, in the distributed optimizer's per-bucket format.
    assert any(k.startswith("critic.optimizer.") and k.endswith("exp_avg") for k in keys), sorted(
        keys)[:20]


def test_a_generation_spans_a_weight_update(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "sft.steps=0",
            f"run_dir={run}", "checkpoint.dir=null", "logger.wandb_mode=disabled",
            "data.source=jsonl", f"data.path={letter_prompts(tmp_path / 'p.jsonl')}",
            f"+rewards.plugins.{PLUGIN}", "rl.steps=4", "rl.prompts_per_step=2",
            "rl.group_size=2", "rl.max_generation_rounds=1", "rl.dynamic_sampling=false",
            "rl.mode=async", "rl.max_staleness=1", "rollout.partial_rollouts=true",
            "rl.updates_per_step=2", "rl.sampling.max_tokens=512", "rl.sampling.ignore_eos=true",
            "rl.use_reference=false", "+rl.objective_args.kl_coef=0.0",
            "+rl.objective_args.is_correction.mode=tis"]  # fmt: skip
    plugins = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": plugins})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "weights/version" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert all(r["rollout/response_length"] == 512 for r in steps)
    spanned = [r for r in steps if r["async/spanning_versions"] > 0]
    assert spanned, [{k: v for k, v in r.items() if k.startswith(("async/", "time/"))}
                     for r in steps]
    for r in spanned:  # trained one version on: both versions' tokens kept and corrected
        assert r["async/dropped_stale"] == 0 and r["async/masked_stale_tokens"] == 0, r
        assert r["train/is/versions_per_seq_max"] == 2.0, r
        assert 0.0 < r["train/is/older_version_frac"] < 1.0, r
    for r in steps:
        if r["async/spanning_versions"] == 0:
            assert r["train/is/versions_per_seq_max"] == 1.0
            assert r["train/is/older_version_frac"] == 0.0
