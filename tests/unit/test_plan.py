"""The layout planner: what it accepts, rejects and prefers, and its command line."""

from __future__ import annotations

import json

import pytest

from moerl.launchers.cli import main
from moerl.models.arch import DEEPSEEK_V3, KIMI_K2, TINY
from moerl.parallel.layout import ParallelLayout
from moerl.planning.cost import ClusterSpec, stage_imbalance, step_time
from moerl.planning.memory import GiB, RunSettings
from moerl.planning.plan import Candidate, SearchSettings, check_layout, judge, plan
from moerl.planning.report import load_plan_config
from moerl.planning.rollout_fit import RolloutSettings, rollout_options
from moerl.rollout.kv_layout import kv_bytes_per_token_layer
from moerl.typed_config import ConfigError

SEARCH = SearchSettings()


@pytest.fixture(scope="module")
def kimi_128_nodes() -> tuple[list[Candidate], int]:
    return plan(KIMI_K2, ClusterSpec(nodes=128), RunSettings(seq_length=4096), SEARCH)


def test_kimi_k2_on_128_nodes_finds_fitting_layouts(
    kimi_128_nodes: tuple[list[Candidate], int],
) -> None:
    fitting, considered = kimi_128_nodes
    assert fitting and considered > len(fitting)
    budget = 80 * GiB * (1 - SEARCH.safety_margin)
    for c in fitting:
        assert c.fits and c.memory.total <= budget
        assert c.layout.world_size == 1024
        assert c.layout.tp <= 8  # tensor parallelism stays inside a node
    times = [c.time.total for c in fitting]
    assert times == sorted(times)


@pytest.mark.parametrize(("arch", "nodes"), [(DEEPSEEK_V3, 128), (KIMI_K2, 256)],
                         ids=["deepseek-v3-128", "kimi-k2-256"])
def test_large_clusters_get_fitting_layouts(arch: object, nodes: int) -> None:
    fitting, _ = plan(arch, ClusterSpec(nodes=nodes), RunSettings(seq_length=4096),  # type: ignore[arg-type]
                      SEARCH)
    assert fitting
    best = fitting[0]
    assert best.layout.world_size == nodes * 8
    assert best.memory.total <= 80 * GiB * (1 - SEARCH.safety_margin)


def test_every_returned_layout_passes_layout_check(
    kimi_128_nodes: tuple[list[Candidate], int],
) -> None:
    fitting, _ = kimi_128_nodes
    for c in fitting:
        assert (c.layout.stage_layers is not None) == c.uneven_pipeline
        c.layout.check(KIMI_K2, 1024, backend="nccl", te_available=True)


def test_even_splits_only_pass_check_on_the_real_arch() -> None:
    search = SearchSettings(uneven_pipeline=False)
    arch = TINY.replace(num_layers=8)
    fitting, _ = plan(arch, ClusterSpec(nodes=2), RunSettings(seq_length=1024,
                                                              global_batch_size=64), search)
    assert fitting
    assert {c.layout.pp for c in fitting} > {1}
    for c in fitting:
        assert not c.uneven_pipeline
        c.layout.check(arch, 16, backend="nccl", te_available=True)


def test_uneven_split_is_refused_when_disabled() -> None:
    from moerl.parallel.layout import LayoutError

    with pytest.raises(LayoutError, match=r"parallel\.pp"):
        check_layout(ParallelLayout(tp=1, pp=16, ep=64, dp=128), DEEPSEEK_V3,
                     SearchSettings(uneven_pipeline=False))


def test_tp_never_exceeds_gpus_per_node() -> None:
    cluster = ClusterSpec(nodes=4, gpus_per_node=4)
    fitting, _ = plan(TINY, cluster, RunSettings(seq_length=512, global_batch_size=64), SEARCH)
    assert fitting and max(c.layout.tp for c in fitting) <= 4


def test_deepseek_v3_rejected_on_one_node() -> None:
    fitting, considered = plan(DEEPSEEK_V3, ClusterSpec(nodes=1), RunSettings(recompute="full"),
                               SEARCH)
    assert considered > 0 and fitting == []


def test_kimi_k2_with_ep1_is_rejected_with_the_reason() -> None:
    c = judge(KIMI_K2, ParallelLayout(tp=8, pp=16, ep=1, dp=8), RunSettings(),
              ClusterSpec(nodes=128), SEARCH, uneven=True)
    assert not c.fits
    assert "GiB > 72.0 GiB" in c.reason and "main_grads" in c.reason


@pytest.mark.parametrize("cf", [None, 1.0])
def test_deepseek_v3_published_layout_fits(cf: float | None) -> None:
    # DeepSeek-V3's own training: PP16 x EP64, no TP, 2048 H800 (80 GB), seq 4096.
    layout = ParallelLayout(tp=1, pp=16, ep=64, dp=128)
    assert check_layout(layout, DEEPSEEK_V3, SEARCH)  # uneven: 61 layers over 16 stages
    run = RunSettings(seq_length=4096, micro_batch_size=1, global_batch_size=15360,
                      recompute="full", moe_capacity_factor=cf)
    c = judge(DEEPSEEK_V3, layout, run, ClusterSpec(nodes=256), SEARCH, uneven=True)
    assert c.fits, c.reason


def test_bubble_shrinks_with_virtual_stages_and_micro_batches() -> None:
    cluster, run = ClusterSpec(nodes=64), RunSettings(global_batch_size=256)
    plain = step_time(KIMI_K2, ParallelLayout(tp=8, pp=8, ep=32, dp=8), run, cluster)
    inter = step_time(KIMI_K2, ParallelLayout(tp=8, pp=8, vpp=2, ep=32, dp=8), run, cluster)
    assert inter.bubble < plain.bubble
    more = step_time(KIMI_K2, ParallelLayout(tp=8, pp=8, ep=32, dp=8),
                     RunSettings(global_batch_size=512), cluster)
    assert more.bubble / more.compute < plain.bubble / plain.compute


def test_inter_node_ep_costs_more_than_intra_node() -> None:
    cluster, run = ClusterSpec(nodes=16), RunSettings(global_batch_size=256)
    inside = step_time(KIMI_K2, ParallelLayout(tp=1, pp=16, ep=8, dp=8), run, cluster)
    across = step_time(KIMI_K2, ParallelLayout(tp=1, pp=16, ep=8, etp=1, dp=8), run,
                       ClusterSpec(nodes=16, gpus_per_node=8, inter_node_gbps=25.0))
    spread = step_time(KIMI_K2, ParallelLayout(tp=1, pp=2, ep=64, dp=64), run, cluster)
    assert inside.ep == across.ep  # ep 8 stays on NVLink whatever the network
    assert spread.ep > inside.ep


def test_stage_imbalance_counts_the_output_head() -> None:
    assert stage_imbalance(TINY, ParallelLayout(), 1024) == 1.0
    assert stage_imbalance(KIMI_K2, ParallelLayout(tp=8, pp=32, ep=8, dp=4), 4096) > 1.5


def test_rollout_engines_for_kimi_k2() -> None:
    settings = RolloutSettings(nodes=32, concurrent_sequences=192, context_length=4096)
    options = rollout_options(KIMI_K2, settings, 8, 80.0, kv_bytes_per_token_layer)
    best = options[0]
    assert best.fits and best.replicas * best.gpus <= 256
    assert (best.tp, best.ep, best.replicas, best.needed_rows) == (8, 32, 8, 24)
    one_node = [o for o in options if o.gpus == 8]
    assert one_node and not any(o.fits for o in one_node)  # 1T fp8 weights > 8 x 80 GB
    # The engine caches per-head keys and values: 2.5 MB a token at TP1, so a TP1 engine
    # holds two 4096-token rows beside its 42.8 GiB of FP8 weights (43.4B parameters).
    assert kv_bytes_per_token_layer(KIMI_K2, 1) * 61 == 64 * (192 + 128) * 2 * 61
    tp1 = next(o for o in options if (o.tp, o.ep) == (1, 32))
    assert not tp1.fits and tp1.rows == 2 and tp1.weights_gb == pytest.approx(42.8, abs=0.05)


def test_bf16_rollout_weights_do_not_fit_tp1_ep32() -> None:
    """Serving Kimi-K2 at bf16 over 32 GPUs: 43.4B parameters a GPU, 80.9 GiB."""
    bf16 = RolloutSettings(nodes=32, concurrent_sequences=8, context_length=4096,
                           weight_dtype="bf16")
    tp1 = next(o for o in rollout_options(KIMI_K2, bf16, 8, 80.0, kv_bytes_per_token_layer)
               if (o.tp, o.ep) == (1, 32))
    assert tp1.weights_gb == pytest.approx(80.9, abs=0.05) and not tp1.fits and tp1.rows == 0


def test_overrides_parse_and_unknown_keys_are_named() -> None:
    config = load_plan_config(["model=deepseek-v3", "cluster.nodes=64", "run.seq_length=8192",
                               "run.moe_capacity_factor=1.25"])
    assert config.cluster.nodes == 64 and config.run.seq_length == 8192
    assert config.run.moe_capacity_factor == 1.25
    with pytest.raises(ConfigError, match=r"cluster\.gpus: unknown key"):
        load_plan_config(["cluster.gpus=8"])
    with pytest.raises(ConfigError, match=r"run\.recompute"):
        load_plan_config(["run.recompute=sometimes"])


def test_cli_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "model=tiny", "cluster.nodes=2", "rollout.nodes=1",
                 "run.seq_length=512", "run.global_batch_size=32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fitting"] > 0 and out["best"][0]["fits"]
    assert set(out["best"][0]["memory_gib"]) >= {"weights", "main_grads", "activations", "total"}
    # One save of the tiny model: 2.5M parameters x (2 + 4 + 8) bytes at 50 GB/s.
    save = out["checkpoint"]
    assert save["write_gbps"] == 50 and 30e6 < save["bytes"] < 40e6
    assert save["seconds"] == pytest.approx(save["bytes"] / 50e9)
    assert save["interval_minutes"] == 30


def test_cli_plan_shows_the_save_of_each_h100_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "model=kimi-k2", "cluster.nodes=160", "rollout.nodes=32",
                 "run.precision=fp8", "cluster.checkpoint_write_gbps=100"]) == 0
    assert ("one checkpoint: 13.35 TB (weights, fp32 master, Adam moments), 133 s at "
            "100 GB/s") in capsys.readouterr().out


def test_the_jobs_gpu_nodes_are_trainer_plus_rollout() -> None:
    config = load_plan_config(["cluster.nodes=160", "rollout.nodes=32"])
    assert config.trainer_cluster().nodes == 128 and config.trainer_cluster().world_size == 1024
    with pytest.raises(ConfigError, match=r"cluster\.nodes=32: the rollout engines take "
                                          r"rollout\.nodes=32"):
        load_plan_config(["cluster.nodes=32", "rollout.nodes=32"])


def test_cli_plan_unknown_key_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "cluster.nodez=4"]) == 2
    assert "cluster.nodez" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["kimi_k2_h100", "deepseek_v3_h100"])
def test_recipes_hold_a_layout_the_planner_accepts(name: str) -> None:
    from moerl.config import compose
    from moerl.models.arch import MoEArch
    from moerl.typed_config import from_dict

    data = compose([f"+experiment={name}"])
    arch = from_dict(MoEArch, data["model"], "model")
    layout = ParallelLayout(**data["parallel"])
    assert layout.world_size == data["cluster"]["trainer_nodes"] * 8
    run = RunSettings(**data["run"])
    uneven = check_layout(layout, arch, SEARCH)
    c = judge(arch, layout, run, ClusterSpec(nodes=data["cluster"]["trainer_nodes"]), SEARCH,
              uneven)
    assert c.fits, c.reason
