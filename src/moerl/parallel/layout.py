"""How a model is split over ranks, and every rule a layout must obey.

A `ParallelLayout` is the `parallel` config group: tensor (tp), pipeline (pp, with
vpp virtual stages per rank), expert (ep, with etp expert-tensor), context (cp)
and data (dp) parallelism. `check` rejects an impossible layout at start-up with
a message naming the field and the fix, before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol


class ModelShape(Protocol):
    """What a layout's rules read of a model (`moerl.models.arch.MoEArch` is one).

    A protocol rather than the class: `parallel` sits below `models`, which builds
    models for a layout."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def moe_ffn_hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def attention(self) -> Literal["mla", "gqa"]: ...
    @property
    def num_query_groups(self) -> int | None: ...
    @property
    def ffn_hidden_size(self) -> int: ...
    @property
    def shared_expert_ffn_hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message names the field and the fix."""


@dataclass
class ParallelLayout:
    """Degrees of parallelism. world size = tp * pp * cp * dp.

    The expert layers re-slice the same ranks: tp * cp * dp = etp * ep * expert-dp.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages per pipeline rank (interleaved 1F1B)
    ep: int = 1
    etp: int = 1  # tensor parallelism inside each expert
    cp: int = 1
    dp: int = 1
    # None: on exactly when tp > 1 (Megatron's MoE layers require it then).
    sequence_parallel: bool | None = None
    # None: off where the backend is gloo with virtual stages (batched p2p gives a
    # wrong loss there without any error), on otherwise.
    batch_p2p_comm: bool | None = None
    use_distributed_optimizer: bool = True
    # Decoder layers in each pipeline chunk, in model order (pp * vpp entries; chunk j
    # runs on pipeline rank j % pp). None: an even split. Needed for layer counts that
    # pp * vpp does not divide (61-layer DeepSeek-V3 / Kimi-K2 over 16 stages).
    stage_layers: list[int] | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        return (self.tp * self.cp * self.dp) // (self.ep * self.etp)

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1

    def resolved_sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    def sequence_multiple(self) -> int:
        """What a row's length must be a multiple of: 2·CP equal chunks (CP > 1), each
        rank's share split over TP under sequence parallelism."""
        multiple = self.tp if self.resolved_sequence_parallel() else 1
        return multiple * (2 * self.cp if self.cp > 1 else 1)

    def resolved_batch_p2p_comm(self, backend: str) -> bool:
        if self.batch_p2p_comm is not None:
            return self.batch_p2p_comm
        return not (backend == "gloo" and self.vpp is not None)

    def layers_per_chunk(self, num_layers: int) -> list[int]:
        """Decoder layers of each pipeline chunk (pp * vpp of them), in model order."""
        if self.stage_layers is not None:
            return list(self.stage_layers)
        chunks = self.pp * self.virtual_stages
        return [num_layers // chunks] * chunks

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        if self.stage_layers is not None:
            parts.append("uneven")
        parts += [f"ep{self.ep}", f"etp{self.etp}", f"cp{self.cp}", f"dp{self.dp}"]
        return "-".join(parts)

    @classmethod
    def for_world(cls, world_size: int, **degrees: int | bool | None) -> ParallelLayout:
        """A layout with dp filled in so that tp * pp * cp * dp = world_size."""
        layout = cls(**degrees)  # type: ignore[arg-type]
        model_parallel = layout.tp * layout.pp * layout.cp
        if world_size % model_parallel:
            raise LayoutError(
                f"parallel: world size {world_size} is not divisible by tp*pp*cp = "
                f"{model_parallel}; change tp/pp/cp or the number of ranks"
            )
        layout.dp = world_size // model_parallel
        return layout

    def check(
        self,
        arch: ModelShape,
        world_size: int | None = None,
        backend: str = "gloo",
        te_available: bool = False,
    ) -> None:
        """Raise `LayoutError` for the first rule this layout breaks."""
        _check_degrees(self)
        if world_size is not None and world_size != self.world_size:
            raise LayoutError(
                f"parallel: tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = "
                f"{self.world_size}, but {world_size} ranks were started; set parallel.dp="
                f"{max(world_size // (self.tp * self.pp * self.cp), 1)} or start "
                f"{self.world_size} ranks"
            )
        _check_experts(self, arch)
        _check_pipeline(self, arch, backend)
        _check_tensor(self, arch)
        # Context parallelism runs on TE's attention where TE is present and on the
        # project's ring attention (models/ring_attention.py) elsewhere.


def _check_degrees(layout: ParallelLayout) -> None:
    for name in ("tp", "pp", "ep", "etp", "cp", "dp"):
        value = getattr(layout, name)
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"parallel.{name}: must be a positive integer, got {value!r}")
    if layout.vpp is not None and layout.vpp < 2:
        raise LayoutError(
            f"parallel.vpp: must be null or >= 2 virtual stages per rank, got {layout.vpp}"
        )


def _check_experts(layout: ParallelLayout, arch: ModelShape) -> None:
    if arch.num_experts % layout.ep:
        raise LayoutError(
            f"parallel.ep: {arch.num_experts} experts cannot be split evenly over ep="
            f"{layout.ep} ranks; choose an ep that divides {arch.num_experts}"
        )
    expert_group = layout.ep * layout.etp
    dense_group = layout.tp * layout.cp * layout.dp
    if dense_group % expert_group:
        raise LayoutError(
            f"parallel.ep: ep*etp = {expert_group} must divide tp*cp*dp = {dense_group} "
            "(the expert layers re-slice the same ranks); lower ep or etp, or raise dp"
        )
    if arch.moe_ffn_hidden_size % layout.etp:
        raise LayoutError(
            f"parallel.etp: expert FFN size {arch.moe_ffn_hidden_size} is not divisible by "
            f"etp={layout.etp}; choose an etp that divides it"
        )


def uneven_split(num_layers: int, chunks: int) -> list[int]:
    """floor(L/S) layers per chunk; the L mod S extra ones go to middle chunks first,
    so the first chunk (embedding, most in-flight micro-batches) and the last (output
    head, loss, MTP) stay light."""
    base, extra = divmod(num_layers, chunks)
    order = [*range(chunks - 2, 0, -1), 0, chunks - 1] if chunks > 1 else [0]
    sizes = [base] * chunks
    for j in order[:extra]:
        sizes[j] += 1
    return sizes


def _check_pipeline(layout: ParallelLayout, arch: ModelShape, backend: str) -> None:
    stages = layout.pp * layout.virtual_stages
    if layout.vpp is not None and layout.pp < 2:
        raise LayoutError("parallel.vpp: virtual stages need pp >= 2; set parallel.vpp=null")
    if layout.stage_layers is not None:
        split = layout.stage_layers
        if len(split) != stages or min(split) < 1 or sum(split) != arch.num_layers:
            raise LayoutError(
                f"parallel.stage_layers: needs pp*vpp = {stages} entries, each >= 1, summing "
                f"to {arch.num_layers} layers; got {split}"
            )
    elif arch.num_layers % stages:
        suggestion = uneven_split(arch.num_layers, stages) if stages <= arch.num_layers else None
        fix = f" or set parallel.stage_layers={suggestion}" if suggestion else ""
        raise LayoutError(
            f"parallel.pp: {arch.num_layers} layers cannot be split evenly over pp*vpp = "
            f"{stages} stages; choose pp (and vpp) whose product divides {arch.num_layers}{fix}"
        )
    if layout.vpp is not None and backend == "gloo" and layout.batch_p2p_comm:
        raise LayoutError(
            "parallel.batch_p2p_comm: batched p2p with virtual stages on gloo computes a wrong "
            "loss without any error; set parallel.batch_p2p_comm=false (or leave it null)"
        )


def _check_tensor(layout: ParallelLayout, arch: ModelShape) -> None:
    tp = layout.tp
    if arch.num_attention_heads % tp:
        raise LayoutError(
            f"parallel.tp: {arch.num_attention_heads} attention heads are not divisible by "
            f"tp={tp}; choose a tp that divides the head count"
        )
    if arch.attention == "gqa" and (arch.num_query_groups or arch.num_attention_heads) % tp:
        raise LayoutError(
            f"parallel.tp: num_query_groups={arch.num_query_groups} is not divisible by tp={tp}"
        )
    if arch.ffn_hidden_size % tp or arch.shared_expert_ffn_hidden_size % tp:
        raise LayoutError(
            f"parallel.tp: the dense / shared-expert FFN sizes ({arch.ffn_hidden_size}, "
            f"{arch.shared_expert_ffn_hidden_size}) must be divisible by tp={tp}"
        )
    if arch.vocab_size % tp:
        raise LayoutError(
            f"parallel.tp: vocab_size {arch.vocab_size} is not divisible by tp={tp}; "
            "pad the vocabulary or change tp"
        )
    if tp > 1 and not layout.resolved_sequence_parallel():
        raise LayoutError(
            "parallel.sequence_parallel: MoE layers with tp > 1 need sequence parallelism; "
            "set parallel.sequence_parallel=true (or leave it null)"
        )
    if tp == 1 and layout.sequence_parallel:
        raise LayoutError(
            "parallel.sequence_parallel: needs tp > 1; set it to null or false, or raise tp"
        )
