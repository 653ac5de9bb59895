"""`rl.advantage=gae` and the `rl.critic` group: each choice accepted, each impossible
combination refused at start-up with the fields named (RLConfig, and the whole run
config composed from the shipped YAML)."""

from __future__ import annotations

from typing import Any

import pytest

from moerl.config import load_run_config
from moerl.models.arch import TINY
from moerl.rl.config import RLConfig
from moerl.rl.critic_config import CriticConfig
from moerl.rl.objective_config import OBJECTIVE_NAMES
from moerl.trainer.config import OptimConfig
from moerl.typed_config import ConfigError


@pytest.mark.parametrize("objective", OBJECTIVE_NAMES)
def test_gae_is_accepted_with_every_objective(objective: str) -> None:
    # Every objective takes per-token advantages (ppo_clip and its variants per token,
    # GSPO's token form, CISPO per token): none ignores them, so none is refused.
    cfg = RLConfig(advantage="gae", objective=objective)
    assert cfg.critic == CriticConfig() and (cfg.gae_gamma, cfg.gae_lambda) == (1.0, 0.95)


@pytest.mark.parametrize("fields", [
    {"gae_gamma": 0.0, "gae_lambda": 0.0},
    {"gae_gamma": 1.0, "gae_lambda": 1.0},
    {"kl_in_reward": 0.05},
    {"mode": "async"},
    {"critic": CriticConfig(lr=1e-4, min_lr=1e-5, clip_grad=0.5, value_clip=None,
                            warmup_steps=29, head_init_std=0.01)},
    {"critic": CriticConfig(model={"num_layers": 2}, init_from_policy=False)},
])
def test_gae_choices_are_accepted(fields: dict[str, Any]) -> None:
    cfg = RLConfig(advantage="gae", **fields)
    for name, value in fields.items():
        assert getattr(cfg, name) == value


@pytest.mark.parametrize(("fields", "message"), [
    ({"critic": CriticConfig(lr=1e-4)}, r"rl\.critic\.lr set with rl\.advantage=grpo.*"
                                        r"set rl\.advantage=gae"),
    ({"advantage": "reinforce_pp", "gae_lambda": 0.9}, r"rl\.gae_lambda set with "
                                                       r"rl\.advantage=reinforce_pp"),
    ({"advantage": "rloo", "gae_gamma": 0.99, "critic": CriticConfig(warmup_steps=2)},
     r"rl\.gae_gamma, rl\.critic\.warmup_steps set with rl\.advantage=rloo"),
    ({"advantage": "gae", "gae_gamma": 1.5}, r"rl\.gae_gamma: must be in \[0, 1\], got 1\.5"),
    ({"advantage": "gae", "gae_lambda": -0.1}, r"rl\.gae_lambda: must be in \[0, 1\]"),
    ({"advantage": "gae", "steps": 3, "critic": CriticConfig(warmup_steps=3)},
     r"rl\.critic\.warmup_steps=3 with rl\.steps=3: the policy would never move"),
    ({"advantage": "grpo", "kl_in_reward": 0.1}, r"rl\.kl_in_reward=0\.1 with rl\.advantage=grpo"),
])
def test_impossible_combinations_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RLConfig(**fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"value_clip": 0.0}, r"rl\.critic\.value_clip: must be > 0"),
    ({"lr": 0.0}, r"rl\.critic\.lr: must be > 0"),
    ({"lr": 1e-4, "min_lr": 1e-3}, r"rl\.critic\.min_lr: need 0 <= min_lr <= rl\.critic\.lr"),
    ({"clip_grad": -1.0}, r"rl\.critic\.clip_grad: must be >= 0"),
    ({"warmup_steps": -1}, r"rl\.critic\.warmup_steps: must be >= 0"),
    ({"head_init_std": -0.1}, r"rl\.critic\.head_init_std: must be >= 0"),
    ({"model": {"layers": 2}, "init_from_policy": False},
     r"rl\.critic\.model\.layers: not a field of the model architecture"),
    ({"model": {"vocab_size": 256}, "init_from_policy": False},
     r"rl\.critic\.model\.vocab_size: the critic reads the policy's tokens"),
    ({"model": {"num_layers": 2}}, r"rl\.critic\.model=.* with rl\.critic\.init_from_policy=true"),
])
def test_critic_fields_are_checked(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CriticConfig(**fields)


def test_the_critic_takes_the_policys_architecture_and_optimizer_with_its_fields() -> None:
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, clip_grad=1.0)
    assert CriticConfig().arch(TINY) == TINY and CriticConfig().optim(optim) == optim
    small = CriticConfig(model={"num_layers": 2}, init_from_policy=False)
    assert small.arch(TINY).num_layers == 2 and small.arch(TINY).hidden_size == TINY.hidden_size
    own = CriticConfig(lr=5e-5, clip_grad=0.5).optim(optim)
    assert (own.lr, own.min_lr, own.clip_grad) == (5e-5, 5e-5, 0.5)  # min_lr capped at lr
    assert own.weight_decay == optim.weight_decay


def test_the_shipped_yaml_composes_each_choice() -> None:
    cfg = load_run_config(["rl.advantage=gae", "rl.gae_lambda=0.9", "rl.critic.lr=1e-4",
                           "rl.critic.value_clip=null", "rl.critic.warmup_steps=2",
                           "rl.kl_in_reward=0.01"])
    assert cfg.rl.advantage == "gae" and cfg.rl.gae_lambda == 0.9
    assert cfg.rl.critic == CriticConfig(lr=1e-4, value_clip=None, warmup_steps=2)
    small = load_run_config(["rl.advantage=gae", "+rl.critic.model.num_layers=2",
                             "rl.critic.init_from_policy=false"])
    assert small.rl.critic.arch(small.model).num_layers == 2
    assert load_run_config([]).rl.critic == CriticConfig()  # grpo: the defaults, unused


@pytest.mark.parametrize(("overrides", "message"), [
    (["rl.critic.lr=1e-4"], r"rl\.critic\.lr set with rl\.advantage=grpo"),
    (["rl.advantage=gae", "rl.gae_gamma=2"], r"rl\.gae_gamma: must be in \[0, 1\]"),
    (["rl.advantage=gae", "rl.critic.warmup_steps=50", "rl.steps=50"],
     r"rl\.critic\.warmup_steps=50 with rl\.steps=50"),
    (["rl.advantage=gae", "+rl.critic.model.num_layers=0", "rl.critic.init_from_policy=false"],
     r"rl\.critic\.model: "),
])
def test_the_run_config_refuses_at_start_up(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(overrides)
