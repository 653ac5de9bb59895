"""Search parallel layouts for a model on a cluster; rank the ones that fit by step time.

    moerl plan model=kimi-k2 cluster.nodes=160 rollout.nodes=32 run.seq_length=4096 [--json]

`cluster.nodes` are the job's GPU nodes in all: the rollout engines take
`rollout.nodes` of them and the trainer the rest (the reward and environment servers
run on CPU nodes apart). Every (tp, pp, vpp, cp, ep, etp) with tp inside a node,
dp = trainer world / (tp*pp*cp), the global batch divisible by micro-batch * dp and,
with virtual stages, a micro-batch count per data-parallel rank that Megatron's
interleaved schedule takes (a multiple of pp) is built as a `ParallelLayout`
and must pass `ParallelLayout.check`. A layout fits when `memory.memory_breakdown`
of its most loaded rank is at most gpu_memory * (1 - safety_margin); fitting
layouts are ranked by `cost.step_time`.

Where pp*vpp does not divide the layer count (61 layers over pp 16) and
`search.uneven_pipeline` is on, the layout gets an explicit uneven split
(`ParallelLayout.stage_layers`, extra layers on middle stages), which Megatron
builds through its pipeline layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from moerl.models.arch import MoEArch
from moerl.parallel.layout import LayoutError, ParallelLayout, uneven_split
from moerl.planning.cost import ClusterSpec, StepTime, step_time
from moerl.planning.memory import GiB, MemoryBreakdown, RunSettings, fits, memory_breakdown
from moerl.planning.rollout_fit import RolloutSettings
from moerl.planning.run_at_scale import RecipeSettings


@dataclass
class SearchSettings:
    """How the planner searches and what it calls fitting."""

    safety_margin: float = 0.10  # of GPU memory left free for fragmentation and spikes
    top: int = 8  # layouts shown
    uneven_pipeline: bool = True
    max_pp: int = 32
    max_vpp: int = 8
    backend: str = "nccl"
    te_available: bool = True
    distributed_optimizer: bool = True


@dataclass
class PlanConfig:
    """`moerl plan` configuration; every field is a `key=value` override."""

    model: str = "kimi-k2"
    cluster: ClusterSpec = field(default_factory=lambda: ClusterSpec(nodes=160))
    """`nodes`: GPU nodes in all, trainer and rollout."""
    run: RunSettings = field(default_factory=RunSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    search: SearchSettings = field(default_factory=SearchSettings)
    reward_nodes: int = 4
    """CPU nodes for the reward servers; written into a recipe, not planned."""
    environment_nodes: int = 0
    """CPU nodes for the environment servers of agent tasks (0: prompts only); likewise."""
    recipe: RecipeSettings = field(default_factory=RecipeSettings)
    """The run's settings a recipe names beside its layout (`planning.run_at_scale`)."""

    def trainer_cluster(self) -> ClusterSpec:
        """The trainer's share of the GPU nodes: `cluster.nodes` less `rollout.nodes`."""
        nodes = self.cluster.nodes - self.rollout.nodes
        if nodes < 1:
            raise ValueError(f"cluster.nodes={self.cluster.nodes}: the rollout engines take "
                             f"rollout.nodes={self.rollout.nodes} of the GPU nodes and leave "
                             "none to the trainer; raise cluster.nodes (trainer + rollout)")
        return replace(self.cluster, nodes=nodes)


@dataclass
class Candidate:
    """One layout judged: its memory, its predicted step, or why it was rejected."""

    layout: ParallelLayout
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    uneven_pipeline: bool
    reason: str = ""


def check_layout(layout: ParallelLayout, arch: MoEArch, search: SearchSettings) -> bool:
    """`ParallelLayout.check`, after giving an uneven split where one is needed and allowed.

    Returns whether the split is uneven; raises `LayoutError` when a rule is broken.
    """
    stages = layout.pp * layout.virtual_stages
    if stages > arch.num_layers:
        raise LayoutError(f"parallel.pp: pp*vpp = {stages} exceeds {arch.num_layers} layers")
    uneven = arch.num_layers % stages != 0 and search.uneven_pipeline
    if uneven:
        layout.stage_layers = uneven_split(arch.num_layers, stages)
    layout.check(arch, layout.world_size, search.backend, search.te_available)
    return uneven


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def enumerate_layouts(
    arch: MoEArch, cluster: ClusterSpec, run: RunSettings, search: SearchSettings
) -> Iterator[tuple[ParallelLayout, bool]]:
    """Every valid layout for the cluster, with whether its pipeline split is uneven."""
    world = cluster.world_size
    for tp in _powers_of_two(cluster.gpus_per_node):
        for pp in _powers_of_two(min(search.max_pp, arch.num_layers)):
            vpps: list[int | None] = [None]
            if pp > 1:
                vpps += _powers_of_two(search.max_vpp)[1:]
            for cp in _powers_of_two(8):
                if world % (tp * pp * cp) or run.seq_length % (2 * cp):
                    continue
                dp = world // (tp * pp * cp)
                if run.global_batch_size % (run.micro_batch_size * dp):
                    continue
                for vpp in vpps:
                    if vpp and run.micro_batches(dp) % pp:
                        continue  # Megatron's interleaved schedule: groups of pp
                    for etp in sorted({1, tp}):
                        for ep in _powers_of_two(min(arch.num_experts, tp * cp * dp)):
                            layout = ParallelLayout(
                                tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, dp=dp,
                                use_distributed_optimizer=search.distributed_optimizer)
                            try:
                                uneven = check_layout(layout, arch, search)
                            except LayoutError:
                                continue
                            yield layout, uneven


def judge(
    arch: MoEArch,
    layout: ParallelLayout,
    run: RunSettings,
    cluster: ClusterSpec,
    search: SearchSettings,
    uneven: bool = False,
) -> Candidate:
    """Memory and step time of one layout, with the reason when it does not fit."""
    memory = memory_breakdown(arch, layout, run)
    ok = fits(memory, cluster.gpu_memory_gb, search.safety_margin)
    reason = ""
    if not ok:
        budget = cluster.gpu_memory_gb * (1 - search.safety_margin)
        largest = sorted(memory.gib().items(), key=lambda kv: -kv[1])[:3]
        terms = ", ".join(f"{name} {gib:.1f}" for name, gib in largest)
        reason = (f"pipeline rank {memory.pipeline_rank} needs {memory.total / GiB:.1f} GiB > "
                  f"{budget:.1f} GiB ({cluster.gpu_memory_gb:g} GiB less "
                  f"{search.safety_margin:.0%} margin); largest: {terms}")
    return Candidate(layout, memory, step_time(arch, layout, run, cluster), ok, uneven, reason)


@dataclass
class PlanResult:
    """What a search found: the fitting layouts fastest first, and the closest miss."""

    fitting: list[Candidate]
    considered: int
    closest_miss: Candidate | None
    """the rejected layout needing the least memory; its reason says why nothing
    fits when `fitting` is empty (e.g. at a sequence length beyond the cluster)."""


def search_layouts(
    arch: MoEArch, cluster: ClusterSpec, run: RunSettings, search: SearchSettings
) -> PlanResult:
    """Judge every valid layout; keep the fitting ones and the least-memory rejection."""
    fitting: list[Candidate] = []
    closest: Candidate | None = None
    considered = 0
    for layout, uneven in enumerate_layouts(arch, cluster, run, search):
        considered += 1
        candidate = judge(arch, layout, run, cluster, search, uneven)
        if candidate.fits:
            fitting.append(candidate)
        elif closest is None or candidate.memory.total < closest.memory.total:
            closest = candidate
    fitting.sort(key=lambda c: (c.time.total, c.memory.total))
    return PlanResult(fitting, considered, closest)


def plan(
    arch: MoEArch, cluster: ClusterSpec, run: RunSettings, search: SearchSettings
) -> tuple[list[Candidate], int]:
    """(fitting candidates fastest first, number of valid layouts considered)."""
    result = search_layouts(arch, cluster, run, search)
    return result.fitting, result.considered
