"""Speculative decoding metrics over the samples of one call or one RL step.

The per-sample numbers are in `Sample.speculation`; here they are pooled with
named denominators (drafts for the acceptance rate, policy forward steps for the
accepted length), ready for `observability.MetricsLogger.log` (and so W&B).
"""

from __future__ import annotations

from collections.abc import Iterable

from moerl.rollout.types import Sample


def speculation_metrics(samples: Iterable[Sample] | Iterable[list[Sample]],
                        prefix: str = "rollout/spec") -> dict[str, float]:
    """Pooled acceptance over every sample decoded with speculation (groups are flattened).

    - `acceptance_rate`: accepted drafts / drafted tokens, over all samples;
    - `mean_accepted_length`: generated tokens / policy forward steps (1.0 = no gain);
    - `drafts_per_step`: drafted tokens / policy forward steps;
    - `samples`: how many samples carried speculation statistics.
    Empty (no keys) when no sample was decoded speculatively.
    """
    flat: list[Sample] = []
    for item in samples:
        flat.extend(item if isinstance(item, list) else [item])
    stats = [s.speculation for s in flat if s.speculation is not None]
    if not stats:
        return {}
    drafted = sum(s.drafted for s in stats)
    steps = sum(s.steps for s in stats)
    return {
        f"{prefix}/acceptance_rate": sum(s.accepted for s in stats) / drafted if drafted else 0.0,
        f"{prefix}/mean_accepted_length": sum(s.tokens for s in stats) / steps if steps else 0.0,
        f"{prefix}/drafts_per_step": drafted / steps if steps else 0.0,
        f"{prefix}/samples": float(len(stats)),
    }
