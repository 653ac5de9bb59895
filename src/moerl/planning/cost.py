"""A simple step-time model for ranking layouts: compute, pipeline bubble, exposed comms.

    step = compute * (1 + bubble) + sum over comm kinds of exposed * volume / bandwidth

compute   FLOPs from `count.train_flops_per_token` (x 4/3 for full recompute, x 1.05
          for selective) for the step's tokens, spread over all GPUs at
          peak * achievable_fraction, times the slowest stage's share (uneven splits and
          the output head on the last stage make pipeline ranks unequal)
bubble    (pp - 1) / (m * vpp) for m micro-batches per data-parallel rank
tp        sequence parallelism: per layer and micro-batch 2 all-gathers + 2 reduce-
          scatters forward, the same backward; each moves (tp-1)/tp * T*h*2 bytes, T =
          s*b/cp tokens, over NVLink (tp never leaves a node)
cp        ring attention passes K and V around cp ranks forward, twice backward
ep        4 all-to-alls per MoE layer and micro-batch (dispatch and combine, forward and
          backward), each k * T/sp * h * 2 bytes of which (ep-1)/ep leave the rank; the
          share of peers outside the node goes over InfiniBand, the rest over NVLink,
          and the slower of the two sets the time; with etp > 1 the routed tokens are
          also gathered and scattered in the etp group, (etp-1) x that volume on NVLink
pp        each chunk sends its output activations and receives their gradients,
          T/sp * h * 2 bytes each way per micro-batch, across nodes
dp        distributed optimizer: reduce-scatter fp32 grads + all-gather bf16 params,
          (4 + 2) * P * (d-1)/d bytes (all-reduce 2 * 4 * P * (d-1)/d without it),
          dense params over dp*cp and experts over expert-dp, across nodes

Each kind is multiplied by the share not hidden behind compute (`ClusterSpec.exposed_*`).
Ranks are laid out tp fastest, then cp, ep, dp, pp (Megatron's order), which decides
whether a group stays inside a node. This is a ranking model, not a profiler.
"""

from __future__ import annotations

from dataclasses import dataclass

from moerl.models.arch import MoEArch
from moerl.models.count import train_flops_per_token
from moerl.parallel.layout import ParallelLayout
from moerl.planning.memory import RunSettings
from moerl.planning.stages import stage_chunks, stage_params

GB = 1e9
_RECOMPUTE_FLOPS = {"none": 1.0, "selective": 1.05, "full": 4.0 / 3.0}


@dataclass
class ClusterSpec:
    """A GPU cluster; defaults describe H100 SXM nodes (NVLink 4, 8 x 400 Gb/s IB)."""

    nodes: int = 128
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    intra_node_gbps: float = 360.0  # GB/s per GPU each way over NVLink, achievable
    inter_node_gbps: float = 45.0  # GB/s per GPU each way over its InfiniBand NIC
    peak_bf16_tflops: float = 989.0  # dense
    peak_fp8_tflops: float = 1979.0
    achievable_fraction: float = 0.45  # of peak reached by real MoE training GEMMs
    exposed_tp: float = 0.5
    exposed_cp: float = 0.3
    exposed_ep: float = 0.6
    exposed_pp: float = 0.5
    exposed_dp: float = 0.2
    checkpoint_write_gbps: float = 50.0
    """GB/s the shared filesystem takes from all nodes at once (checkpoint_time.py)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("cluster.nodes and cluster.gpus_per_node: must be >= 1")
        if self.checkpoint_write_gbps <= 0:
            raise ValueError("cluster.checkpoint_write_gbps: must be > 0")
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError("cluster.achievable_fraction: must be in (0, 1]")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part, and what they imply."""

    compute: float
    bubble: float
    tp: float
    cp: float
    ep: float
    pp: float
    dp: float
    tokens: int
    world_size: int
    model_flops: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.communication

    @property
    def communication(self) -> float:
        return self.tp + self.cp + self.ep + self.pp + self.dp

    @property
    def tokens_per_gpu_second(self) -> float:
        return self.tokens / self.total / self.world_size

    def mfu(self, peak_tflops: float) -> float:
        """Model FLOPs (no recompute) per second per GPU over the peak."""
        return self.model_flops / self.total / self.world_size / (peak_tflops * 1e12)


def _span_inside_node(stride: int, size: int, gpus_per_node: int) -> int:
    """How many members of a group of `size` ranks, `stride` apart, share a node."""
    return max(1, min(size, gpus_per_node // stride)) if stride <= gpus_per_node else 1


def layer_flops(arch: MoEArch, seq_length: int, moe: bool) -> float:
    """Training FLOPs per token of one decoder layer (count.py, by difference)."""
    base = arch.replace(mtp_num_layers=0, num_layers=2, first_k_dense=0 if moe else 2)
    one = base.replace(num_layers=1, first_k_dense=0 if moe else 1)
    return train_flops_per_token(base, seq_length) - train_flops_per_token(one, seq_length)


def stage_imbalance(arch: MoEArch, layout: ParallelLayout, seq_length: int) -> float:
    """Slowest pipeline rank's FLOPs * pp / all FLOPs (1.0 when perfectly balanced).

    The last rank adds the output head (6*h*V per token and MTP depth) and the MTP
    layers, which is why uneven splits keep it light.
    """
    moe, dense = layer_flops(arch, seq_length, True), layer_flops(arch, seq_length, False)
    head = 6.0 * arch.hidden_size * arch.vocab_size
    stages = []
    for rank in range(layout.pp):
        layers = [i for chunk in stage_chunks(arch, layout, rank) for i in chunk]
        flops = sum(moe if arch.is_moe_layer(i) else dense for i in layers)
        if rank == layout.pp - 1:
            mtp_layer = moe if arch.is_moe_layer(arch.num_layers - 1) else dense
            flops += (head + mtp_layer) * (1 + arch.mtp_num_layers) - mtp_layer
        stages.append(flops)
    return max(stages) * layout.pp / sum(stages)


def _ep_seconds(
    arch: MoEArch, layout: ParallelLayout, run: RunSettings, cluster: ClusterSpec, layers: int
) -> float:
    """All-to-all in the EP group plus, with etp > 1, the routed tokens' gather/scatter."""
    if layers == 0:
        return 0.0
    sp = layout.tp if layout.resolved_sequence_parallel() else 1
    tokens = run.seq_length * run.micro_batch_size / (layout.cp * sp)
    volume = arch.moe_router_topk * tokens * arch.hidden_size * 2.0
    # Expert groups are ep ranks etp apart (order etp-ep-edp-pp).
    local = _span_inside_node(layout.etp, layout.ep, cluster.gpus_per_node)
    intra = volume * (local - 1) / layout.ep / (cluster.intra_node_gbps * GB)
    inter = volume * (layout.ep - local) / layout.ep / (cluster.inter_node_gbps * GB)
    etp = volume * (layout.etp - 1) / (cluster.intra_node_gbps * GB)
    return 4.0 * layers * (max(intra, inter) + etp)


def _dp_seconds(arch: MoEArch, layout: ParallelLayout, cluster: ClusterSpec) -> float:
    split = stage_params(arch, layout, 0)
    bytes_per_param = 6.0 if layout.use_distributed_optimizer else 8.0

    def ring(params: float, group: int, stride: int) -> float:
        if group == 1:
            return 0.0
        local = _span_inside_node(stride, group, cluster.gpus_per_node)
        bw = cluster.intra_node_gbps if local == group else cluster.inter_node_gbps
        return bytes_per_param * params * (group - 1) / group / (bw * GB)

    dense = split.total - split.expert
    return ring(dense, layout.dp * layout.cp, layout.tp) + ring(
        split.expert, layout.expert_dp, layout.etp * layout.ep
    )


def _tp_cp_pp_seconds(
    arch: MoEArch, layout: ParallelLayout, run: RunSettings, cluster: ClusterSpec, layers: int
) -> tuple[float, float, float]:
    """Per micro-batch on one rank: tensor, context and pipeline communication."""
    h, bf16 = arch.hidden_size, 2.0
    tokens = run.seq_length * run.micro_batch_size / layout.cp
    tp = 0.0
    if layout.tp > 1:
        per_collective = (layout.tp - 1) / layout.tp * tokens * h * bf16
        tp = 8 * layers * per_collective / (cluster.intra_node_gbps * GB)
    cp = 0.0
    if layout.cp > 1:
        heads = arch.num_attention_heads / layout.tp
        kv = heads * (arch.qk_head_dim + arch.qk_pos_emb_head_dim + arch.v_head_dim)
        local = _span_inside_node(layout.tp, layout.cp, cluster.gpus_per_node)
        bw = cluster.intra_node_gbps if local == layout.cp else cluster.inter_node_gbps
        cp = 3 * layers * (layout.cp - 1) * tokens * kv * bf16 / (bw * GB)
    pp = 0.0
    if layout.pp > 1:  # send forward activations, receive their gradients, per chunk
        sp = layout.tp if layout.resolved_sequence_parallel() else 1
        pp = 2 * layout.virtual_stages * tokens / sp * h * bf16 / (cluster.inter_node_gbps * GB)
    return tp, cp, pp


def step_time(
    arch: MoEArch, layout: ParallelLayout, run: RunSettings, cluster: ClusterSpec
) -> StepTime:
    """Predicted seconds per optimizer step for `layout` on `cluster`."""
    world = layout.world_size
    tokens = run.global_batch_size * run.seq_length
    flops = train_flops_per_token(arch, run.seq_length) * tokens
    peak = cluster.peak_fp8_tflops if run.precision == "fp8" else cluster.peak_bf16_tflops
    rate = peak * 1e12 * cluster.achievable_fraction * world
    compute = flops * _RECOMPUTE_FLOPS[run.recompute] / rate
    compute *= stage_imbalance(arch, layout, run.seq_length)
    m = run.micro_batches(layout.dp)
    bubble = compute * (layout.pp - 1) / (m * layout.virtual_stages)

    # The rank with the most layers sets the pace of the communication as well.
    layers = max(
        ([i for chunk in stage_chunks(arch, layout, r) for i in chunk] for r in range(layout.pp)),
        key=len,
    )
    moe_layers = sum(arch.is_moe_layer(i) for i in layers)
    tp, cp, pp = _tp_cp_pp_seconds(arch, layout, run, cluster, len(layers))
    ep = _ep_seconds(arch, layout, run, cluster, moe_layers)
    return StepTime(
        compute=compute,
        bubble=bubble,
        tp=cluster.exposed_tp * tp * m,
        cp=cluster.exposed_cp * cp * m,
        ep=cluster.exposed_ep * ep * m,
        pp=cluster.exposed_pp * pp * m,
        dp=cluster.exposed_dp * _dp_seconds(arch, layout, cluster),
        tokens=tokens,
        world_size=world,
        model_flops=flops,
    )
