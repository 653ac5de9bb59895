"""Reward functions plug in by import path ("package.module:attr") from the config.

The attribute is a factory: a class or function taking the shared `Sandbox` (which it
may ignore) and returning an object that satisfies `RewardFunction`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from moerl.rewards.protocol import RewardFunction
from moerl.sandbox import Sandbox

BUILTIN: dict[str, str] = {
    "humaneval": "moerl.rewards.code:HumanEvalReward",
    "stdio": "moerl.rewards.code:StdioReward",
    "math": "moerl.rewards.math:MathReward",
    "format": "moerl.rewards.format:FormatReward",
    "scene": "moerl.rewards.tools:SceneReward",
    "exact_match": "moerl.rewards.exact:ExactMatchReward",
}


class RewardLoadError(ValueError):
    pass


def load_reward(path: str, sandbox: Sandbox | None) -> RewardFunction:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RewardLoadError(f"reward path {path!r} must look like 'package.module:attr'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardLoadError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise RewardLoadError(f"module {module_name!r} has no attribute {attr!r} ({path!r})")
    if not callable(factory):
        raise RewardLoadError(f"{path!r} is not callable; expected a reward factory")
    reward = factory(sandbox)
    if not isinstance(reward, RewardFunction) or not isinstance(reward.name, str):
        raise RewardLoadError(
            f"{path!r} built {type(reward).__name__}, which lacks `name: str` and "
            "`score(completion, spec) -> RewardResult`"
        )
    return reward


def load_rewards(paths: Mapping[str, str], sandbox: Sandbox | None) -> dict[str, RewardFunction]:
    """name -> reward function, for every entry of `paths` (name -> import path)."""
    return {name: load_reward(path, sandbox) for name, path in paths.items()}
