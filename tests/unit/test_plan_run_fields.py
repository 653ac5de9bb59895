"""The planner's run settings and the run config's precision and recompute groups
(moerl.planning.run_fields): a planned run composes back to what was planned, and
what the memory model has no term for is refused by field."""

from __future__ import annotations

import pytest

from moerl.config import load_run_config
from moerl.models.precision import PrecisionConfig, RecomputeConfig
from moerl.planning.memory import RunSettings
from moerl.planning.run_fields import run_overrides, settings_of_run


@pytest.mark.parametrize(("precision", "layer_spec", "recompute"), [
    ("fp8", "te", "selective"), ("fp8", "te", "full"), ("bf16", "te", "none"),
    ("bf16", "local", "full"), ("fp32", "local", "none"), ("fp32", "te", "selective"),
])  # fmt: skip
def test_planned_settings_compose_back_to_themselves(
        precision: str, layer_spec: str, recompute: str) -> None:
    run = RunSettings(precision=precision, layer_spec=layer_spec, recompute=recompute)  # type: ignore[arg-type]
    cfg = load_run_config(run_overrides(run))
    planned = settings_of_run(cfg.precision, cfg.recompute)
    assert (planned.precision, planned.layer_spec, planned.recompute) == (
        precision, layer_spec, recompute)


def test_plans_a_run_cannot_follow_are_refused() -> None:
    with pytest.raises(ValueError, match=r"run\.precision=fp8 needs run\.layer_spec=te"):
        run_overrides(RunSettings(precision="fp8", layer_spec="local"))
    with pytest.raises(ValueError, match=r"run\.recompute=selective"):
        run_overrides(RunSettings(precision="bf16", layer_spec="local", recompute="selective"))


@pytest.mark.parametrize(("precision", "recompute", "field"), [
    (PrecisionConfig(), RecomputeConfig(), "precision.transformer_impl"),
    (PrecisionConfig("transformer_engine", "bf16", offload_optimizer=True), RecomputeConfig(),
     "precision.offload_"),
    (PrecisionConfig("transformer_engine", "bf16"),
     RecomputeConfig("selective", modules=["core_attn"]), "recompute.modules"),
])  # fmt: skip
def test_what_the_memory_model_cannot_count_is_refused(
        precision: PrecisionConfig, recompute: RecomputeConfig, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        settings_of_run(precision, recompute)


def test_fp8_gemms_with_bf16_weights_count_as_bf16() -> None:
    planned = settings_of_run(PrecisionConfig("transformer_engine", "bf16", fp8="delayed"),
                              RecomputeConfig())
    assert planned.precision == "bf16"
