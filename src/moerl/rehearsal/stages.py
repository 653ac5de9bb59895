"""Which ranks of a job differ: one representative per distinct pipeline stage.

Ranks of one pipeline stage hold the same parameter counts whatever their tensor,
context, data or expert rank (every shard of a layer is the same size), so a stage is
represented by its first rank. Stages differ by what they hold: the embedding (first),
the output head and MTP (last), and their dense and MoE layers; stages holding the
same are built once. Megatron orders ranks tp fastest, then cp, dp and pp (its
"tp-cp-ep-dp-pp"), so stage r starts at global rank r * tp * cp * dp.
"""

from __future__ import annotations

from dataclasses import dataclass

from moerl.models.arch import MoEArch
from moerl.parallel.layout import ParallelLayout
from moerl.planning.stages import stage_chunks


@dataclass(frozen=True)
class Stage:
    """A pipeline stage to rehearse and the stages it stands for."""

    pp_rank: int
    rank: int  # its first global rank
    same_as: tuple[int, ...]  # pipeline ranks holding the same (itself included)


def distinct_stages(arch: MoEArch, layout: ParallelLayout) -> list[Stage]:
    """One `Stage` per distinct pipeline stage of `layout`, first rank first."""
    groups: dict[tuple[bool, bool, int, int], list[int]] = {}
    for pp_rank in range(layout.pp):
        layers = [i for chunk in stage_chunks(arch, layout, pp_rank) for i in chunk]
        moe = sum(arch.is_moe_layer(i) for i in layers)
        key = (pp_rank == 0, pp_rank == layout.pp - 1, len(layers) - moe, moe)
        groups.setdefault(key, []).append(pp_rank)
    per_stage = layout.tp * layout.cp * layout.dp
    return sorted((Stage(ranks[0], ranks[0] * per_stage, tuple(ranks))
                   for ranks in groups.values()), key=lambda s: s.pp_rank)
