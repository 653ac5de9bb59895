"""The bytes one rank builds: trainer ranks through the run's builder of its models, rollout
ranks through the engine's model and KV cache, each on a fake rank (`fake_rank`).

Trainer terms (`trainer.memory_census`): the policy's weights, main_grads (with DDP's
bucket padding), master_weights and adam_states (Adam's moments made as before a
checkpoint load); the reference model's weights; the critic's four terms, prefixed
`critic_`. Rollout terms: the serving weights and the KV cache the static decoder's
attention layers allocate for `rows` rows of `positions` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.precision import ResolvedPrecision
from moerl.parallel.groups import ParallelGroups
from moerl.parallel.layout import ParallelLayout
from moerl.rehearsal.fake_rank import fake_rank
from moerl.rehearsal.stand_in import fp8_weight_width
from moerl.rollout.static_decode import allocate_kv_cache, cache_bytes
from moerl.trainer.memory_census import init_optimizer_state, trainable_bytes, weight_bytes
from moerl.trainer.optimizer import Trainable

if TYPE_CHECKING:
    from moerl.rl.peers import Peers

BuildPeers = Callable[[ParallelGroups], "Peers"]


def _trainable_terms(trainable: Trainable, fp8: bool) -> dict[str, int]:
    init_optimizer_state(trainable.optimizer)
    width = fp8_weight_width(list(trainable.model)) if fp8 else None
    terms = trainable_bytes(trainable.model, trainable.optimizer, width)
    terms["main_grads"] += terms.pop("grad_buffer_padding")
    return terms


def trainer_rank_bytes(layout: ParallelLayout, rank: int, build: BuildPeers, fp8: bool
                       ) -> tuple[int, dict[str, int]]:
    """(pipeline rank, bytes per term) of global trainer `rank`, built by `build`."""
    with fake_rank(layout, rank) as groups:
        peers = build(groups)
        terms = _trainable_terms(peers.policy.trainable, fp8)
        reference = peers.reference.chunks if peers.reference is not None else []
        terms["reference_weights"] = weight_bytes(
            reference, fp8_weight_width(reference) if fp8 else None)
        if peers.critic is not None:
            critic = _trainable_terms(peers.critic.trainable, fp8)
            terms.update({f"critic_{name}": value for name, value in critic.items()})
        return groups.pp_rank, terms


def trainable_census(layout: ParallelLayout, rank: int,
                     build: Callable[[ParallelGroups], Trainable]) -> dict[str, int]:
    """The raw census (padding apart) of what `build` makes on global `rank`, as a run
    that really allocates measures it (tests/distributed/memory_worker.py)."""
    with fake_rank(layout, rank) as groups:
        trainable = build(groups)
        init_optimizer_state(trainable.optimizer)
        return trainable_bytes(trainable.model, trainable.optimizer)


def rollout_rank_bytes(arch: MoEArch, layout: ParallelLayout, rank: int,
                       precision: ResolvedPrecision, fp8: bool, rows: int, positions: int
                       ) -> tuple[int, dict[str, int]]:
    """(pipeline rank, bytes per term) of rank `rank` of one rollout engine."""
    with fake_rank(layout, rank) as groups:
        # Initial values are not data here: skip drawing them (shapes and dtypes alike).
        (model,) = build_model(arch, layout, precision=precision, backend=groups.backend,
                               perform_initialization=False)
        model.eval()
        width = fp8_weight_width([model]) if fp8 else None
        cache = allocate_kv_cache(model, rows, positions)
        return groups.pp_rank, {"weights": weight_bytes([model], width),
                                "kv_cache": cache_bytes(cache)}
