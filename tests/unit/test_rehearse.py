"""`moerl rehearse` on the Kimi-K2 recipe: its ranks built at the real size on a fake
process group, without memory, agree with the plan and fit; what does not fit is refused
naming the rank and the term.

Each rehearsal here builds one distinct rank of a kind (the trainer stage the planner
finds busiest, or one rollout rank); `moerl rehearse +experiment=NAME` builds them all.
"""

from __future__ import annotations

import pytest

from moerl.launchers.rehearse import rehearse
from moerl.models.arch import KIMI_K2
from moerl.parallel.layout import ParallelLayout, uneven_split
from moerl.rehearsal.stages import distinct_stages
from moerl.rehearsal.verdict import TOLERANCE, GiB, Rehearsed, judge
from moerl.rollout.kv_layout import kv_bytes_per_token_layer

KIMI = "+experiment=kimi_k2_h100"


def test_kimi_k2_recipe_fits_and_agrees_with_its_plan() -> None:
    result = rehearse([KIMI], busiest=True)
    assert result.refusals == []
    trainer, rollout = result.ranks
    assert (trainer.stage, trainer.pp_rank, trainer.same_as) == ("trainer", 2, tuple(range(2, 31)))
    assert trainer.rank == 2 * 2 * 4 * 4  # pp 2 of tp2 x cp4 x dp4
    for rank in (trainer, rollout):
        for term, built in rank.built.items():
            assert abs(built - rank.planned[term]) <= TOLERANCE * built, (rank.name, term)
        assert rank.total <= rank.budget
    assert trainer.built["reference_weights"] == trainer.built["weights"]
    # The engine's own KV allocation, 24 rows of 4096 tokens at TP8, is what the planner
    # counts from rollout/kv_layout.py, to the byte.
    assert rollout.built["kv_cache"] == rollout.planned["kv_cache"] == (
        24 * 4096 * 61 * kv_bytes_per_token_layer(KIMI_K2, 8))
    # FP8 primary weights reach the rollout ranks: 31.5 GiB a GPU at TP8/EP32.
    assert 30 * GiB < rollout.built["weights"] < 33 * GiB
    assert result.checkpoint.startswith("checkpoint: one save 13.35 TB")
    assert "267 s at 50 GB/s" in result.checkpoint and "SIGUSR1 600 s" in result.checkpoint


def test_a_sigusr1_lead_shorter_than_a_step_and_a_save_is_refused() -> None:
    result = rehearse([KIMI, "cluster.signal_seconds=200"], only="rollout")
    (refusal,) = [p for p in result.refusals if "signal_seconds" in p]
    assert refusal.startswith("cluster.signal_seconds=200: SIGUSR1 comes 200 s before")
    assert "13.35 TB" in refusal


def test_bf16_rollout_at_tp1_ep32_is_refused_naming_rank_and_term() -> None:
    """The launch the recipe once had: 43.4B parameters a GPU in bf16."""
    result = rehearse([KIMI, "rollout.tp=1", "rollout.weight_dtype=bf16",
                       "rollout.concurrent_sequences=8", "rollout.max_batch=1",
                       "precision.fp8_param=false"], only="rollout")
    (rollout,) = result.ranks
    assert rollout.built["weights"] == pytest.approx(80.9 * GiB, rel=1e-3)
    assert [p for p in rollout.problems if "does not fit" in p] == [
        f"rollout rank 0 (pp 0) does not fit: {rollout.total / GiB:.1f} GiB > budget 72.0 "
        "GiB; it would fit without any one of: weights (80.9 GiB)"]


def test_a_reference_model_that_does_not_fit_is_refused() -> None:
    """The layout the recipe once had fits without the reference model (71.1 GiB planned
    for its busiest rank) and not with it."""
    old = [f"parallel.{k}={v}" for k, v in
           dict(tp=2, pp=16, vpp=2, dp=8, stage_layers=uneven_split(61, 32)).items()]
    result = rehearse([KIMI, *(o.replace(" ", "") for o in old)], only="trainer",
                      busiest=True)
    (trainer,) = result.ranks
    (refusal,) = trainer.problems
    assert refusal.startswith("trainer rank 128 (pp 2) does not fit: 79.3 GiB > budget 72.0")
    assert "reference_weights (8.2 GiB)" in refusal.split("without any one of:")[1]
    assert trainer.total - trainer.bytes("reference_weights") <= trainer.budget


def test_a_job_larger_than_the_cluster_is_refused_before_building() -> None:
    result = rehearse([KIMI, "cluster.rollout_nodes=64", "rollout.replicas=16"])
    assert result.ranks == []
    assert result.refusals == ["the job asks 128 trainer + 64 rollout = 192 GPU nodes; "
                               "cluster h100 has 160 (cluster.gpu_nodes)"]
    cpu = rehearse([KIMI, "cluster.reward_nodes=8"])
    assert cpu.refusals == ["the job asks 8 reward + 4 environment = 12 CPU nodes; cluster "
                            "h100 has 8 (cluster.cpu_nodes)"]


def test_distinct_stages_stand_for_the_others() -> None:
    layout = ParallelLayout(tp=2, pp=32, ep=8, cp=4, dp=4, stage_layers=uneven_split(61, 32))
    stages = distinct_stages(KIMI_K2, layout)
    assert [(s.pp_rank, s.rank) for s in stages] == [(0, 0), (1, 32), (2, 64), (31, 992)]
    assert stages[2].same_as == tuple(range(2, 31))


def test_verdict_names_disagreements_and_missing_terms() -> None:
    rank = judge(Rehearsed("trainer", 3, 1, (1,), {"weights": 106, "critic_weights": 5},
                           {"weights": 100.0, "activations": 10.0}, budget=1e9))
    assert rank.problems == [
        "trainer rank 3 (pp 1): weights built 0.00 GiB, planned 0.00 GiB (6% apart)",
        "trainer rank 3 (pp 1): critic_weights is built (0.00 GiB) but the planner has no "
        "term for it"]
    fits = judge(Rehearsed("rollout", 0, 0, (0,), {"weights": 104}, {"weights": 100.0}, 1e9))
    assert fits.problems == [] and fits.total == 104
