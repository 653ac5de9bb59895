"""`rl.objective_args` is typed by `rl.objective` when the run's config is read: the
objective's own config class, checked there, Dr.GRPO's constant filled in."""

from __future__ import annotations

import pytest

from moerl.config import load_run_config
from moerl.rl.config import RLConfig
from moerl.rl.objective_config import (
    OBJECTIVE_CONFIGS,
    AggregationMode,
    DAPOConfig,
    GRPOConfig,
    GSPOConfig,
)
from moerl.typed_config import ConfigError, from_dict


@pytest.mark.parametrize("name", sorted(OBJECTIVE_CONFIGS))
def test_each_objective_gets_its_own_config_class(name: str) -> None:
    rl = from_dict(RLConfig, {"objective": name, "objective_args": {}}, "rl")
    assert type(rl.objective_args) is OBJECTIVE_CONFIGS[name]
    assert type(RLConfig(objective=name).objective_args) is OBJECTIVE_CONFIGS[name]


def test_dr_grpo_divides_by_the_longest_response_unless_told() -> None:
    cfg = load_run_config(["rl.objective=dr_grpo", "rl.sampling.max_tokens=40"], world_size=1)
    assert cfg.rl.objective_args.aggregation is AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM
    assert cfg.rl.objective_args.norm_len == 40.0
    told = load_run_config(["rl.objective=dr_grpo", "+rl.objective_args.norm_len=100"],
                           world_size=1)
    assert told.rl.objective_args.norm_len == 100.0
    agent = RLConfig(objective="dr_grpo", task_source="agent")  # every model turn of an episode
    assert agent.objective_args.norm_len == agent.agent.max_turns * agent.agent.max_new_tokens
    # Any objective aggregated that way gets the same constant.
    gspo = load_run_config(["rl.objective=gspo",
                            "+rl.objective_args.aggregation=seq-mean-token-sum-norm"],
                           world_size=1)
    assert isinstance(gspo.rl.objective_args, GSPOConfig)
    assert gspo.rl.objective_args.norm_len == gspo.rl.sampling.max_tokens


@pytest.mark.parametrize(("overrides", "message"), [
    (["rl.objective=gspo", "+rl.objective_args.dual_clip=2.0"],
     r"rl\.objective_args\.dual_clip: unknown key for GSPOConfig"),
    (["+rl.objective_args.eps_high=wide"], r"rl\.objective_args\.eps_high: expected a number"),
    (["+rl.objective_args.aggregation=token-sum"], r"rl\.objective_args\.aggregation: 'token-sum'"),
    (["+rl.objective_args.is_correction.level=row"], r"rl\.objective_args\.is_correction\.level"),
    (["+rl.objective_args.kl_coef=-1"], r"rl\.objective_args: kl_coef and entropy_coef"),
    (["+rl.objective_args.norm_len=8"], r"rl\.objective_args: norm_len=8\.0 with aggregation"),
    (["rl.objective=grpo2"], r"rl\.objective: unknown objective 'grpo2'; choose one of"),
])
def test_bad_objective_arguments_fail_when_the_config_is_read(
        overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(overrides, world_size=1)


def test_a_config_of_another_objective_is_refused() -> None:
    assert RLConfig(objective="dapo").objective_args == DAPOConfig()
    with pytest.raises(ValueError, match=r"rl\.objective=dapo takes DAPOConfig, got GRPOConfig"):
        RLConfig(objective="dapo", objective_args=GRPOConfig())
    with pytest.raises(ValueError, match=r"rl\.use_reference=false with rl\.objective_args"):
        RLConfig(use_reference=False)  # GRPO's KL term needs the reference
    RLConfig(use_reference=False, objective_args=GRPOConfig(kl_coef=0.0))
