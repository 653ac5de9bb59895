"""`moerl plan`: the layouts that fit a model on a cluster, ranked by predicted step time."""

from __future__ import annotations

from pathlib import Path

from moerl.planning.report import load_plan_config, report
from moerl.rollout.kv_layout import kv_bytes_per_token_layer


def plan_main(overrides: list[str], as_json: bool, recipe: Path | None = None) -> int:
    """`moerl plan`: parse overrides, search, print a table (or JSON). 0 when a layout
    fits. With `recipe`, the best layout is also written there as a recipe."""
    config = load_plan_config(overrides)
    return report(config, as_json, kv_bytes_per_token_layer, recipe=recipe, overrides=overrides)
