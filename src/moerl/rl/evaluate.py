"""Held-out evaluation through the same rollout and reward servers as training.

One sample per held-out prompt at `rl.eval_temperature` (greedy by default), each
domain with its own sampling settings otherwise; terminal-domain prompts run as
episodes. Logged: eval/pass_rate (reward 1), eval/mean_reward, eval/infra_errors
over all prompts and, in a mixture, eval_pass_rate/<d>, eval_reward/<d> per domain.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from moerl.data.prompts import PromptRecord
from moerl.rl.config import RLConfig
from moerl.rl.domains import Generation, domain_metrics, run_round


def evaluate(gen: Generation, cfg: RLConfig, records: Sequence[PromptRecord],
             step: int) -> dict[str, float]:
    if not records:
        return {}
    groups, _ = run_round(gen, cfg, records, seed=step, step=-1 - step,
                          temperature=cfg.eval_temperature, group_size=1)
    every = [r for g in groups for r in g.rewards()]
    rewards = [r for r in every if r is not None]
    infra = len(every) - len(rewards)
    per_domain = {k: v for k, v in domain_metrics(groups, prefix="eval_").items()
                  if k.startswith(("eval_pass_rate/", "eval_reward/"))}
    return {
        "eval/pass_rate": statistics.fmean(r == 1.0 for r in rewards) if rewards else 0.0,
        "eval/mean_reward": statistics.fmean(rewards) if rewards else 0.0,
        "eval/infra_errors": float(infra),
        **per_domain,
    }
