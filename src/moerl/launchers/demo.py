"""`moerl demo`: the default run on one CPU machine."""

from __future__ import annotations


def run_demo(overrides: list[str]) -> int:
    from moerl.launchers.lm import run_lm

    return run_lm(overrides)
