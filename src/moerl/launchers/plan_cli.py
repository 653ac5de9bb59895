"""`moerl plan`: the layouts that fit a model on a cluster, ranked by predicted step time."""

from __future__ import annotations

from moerl.planning.report import load_plan_config, report


def plan_main(overrides: list[str], as_json: bool) -> int:
    """`moerl plan`: parse overrides, search, print a table (or JSON). 0 when a layout fits."""
    config = load_plan_config(overrides)
    return report(config, as_json)
