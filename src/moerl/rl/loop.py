"""The RL algorithm, top to bottom.

    prompts -> rollout servers (n samples each) -> reward servers -> dynamic sampling
    -> update (reference logprobs -> values -> advantages -> critic update -> policy
    update) -> weight sync -> metrics -> checkpoint / evaluation

The models are peers (rl/peers.py): the policy, the frozen reference model and PPO's
critic are separate objects, none holding another; `update` asks each in turn.

Every trainer rank runs `run_steps`; only the controller rank (global rank 0) talks to
the servers, and the batch it collects is broadcast to the others. In async mode
the collection of step n+1 runs in a background thread while step n trains; a
sample whose weights are more than `max_staleness` versions behind the policy it
would train is dropped, never trained on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from moerl.data.mixture import MixtureStream
from moerl.data.prompts import PromptRecord, PromptStream
from moerl.data.rl_batch import RLSample
from moerl.observability import MetricsLogger, StepTimer
from moerl.rewards.client import RewardClient
from moerl.rl.agent_collect import AgentCollector, agent_metrics
from moerl.rl.batch import Batch
from moerl.rl.config import RLConfig
from moerl.rl.domains import DomainRun, Generation, domain_metrics, run_round
from moerl.rl.evaluate import evaluate
from moerl.rl.group import Group, group_metrics
from moerl.rl.peers import Peers
from moerl.rl.update_advantages import critic_steps, gae_step, reinforce_pp_step, sat_out
from moerl.rl.weight_sync import WeightSync
from moerl.rollout.client import RolloutClient
from moerl.rollout.speculative.metrics import speculation_metrics


@dataclass
class Controller:
    """What only the controller rank holds: the servers' clients and the data."""

    rollout_client: RolloutClient
    reward_client: RewardClient
    prompts: PromptStream | MixtureStream
    held_out: list[PromptRecord]
    encode: Callable[[PromptRecord], list[int]]
    """A prompt's ids (plain text, or a conversation through the chat template)."""
    logger: MetricsLogger
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end a generation besides the servers' EOS (the tokenizer's end of turn)."""
    runs: dict[str, DomainRun] = field(default_factory=dict)
    """A mixture's domains: group size and sampling of each (`data.domains`)."""
    episodes: AgentCollector | None = None
    """Runs terminal-task records as agent episodes (`rl.task_source=agent`, or a
    mixture's terminal domain)."""

    def generation(self) -> Generation:
        return Generation(self.rollout_client, self.reward_client, self.encode, self.stop_token_ids,
                          self.runs, self.episodes)


def collect(ctl: Controller, cfg: RLConfig, step: int) -> Batch:
    """Generate, score and filter until the step has its groups (or rounds run out).

    The one collect path: single-shot prompts, agent tasks (`rl.task_source=agent`) and
    a mixture's terminal domain are all records of the prompt stream, each round's
    groups whatever produced them (rl/group.py)."""
    timer, kept, seen = StepTimer(), list[Group](), list[Group]()
    reward_metrics: dict[str, float] = {}
    for round_ in range(cfg.max_generation_rounds):
        records = ctl.prompts.take(cfg.prompts_per_step)
        # a later round's seed differs: a small task set repeats its records in a step
        seed = cfg.seed * 100_003 + step
        groups, reward_metrics = run_round(ctl.generation(), cfg, records,
                                           seed=seed if round_ == 0 else seed * 101 + round_,
                                           step=step, timer=timer)
        for group in groups:  # settled prompts sit out epochs (rl.difficulty_filter_epochs)
            ctl.prompts.settle(group.record, group.rewards(cfg))
        seen += groups
        kept += [g for g in groups if g.informative] if cfg.dynamic_sampling else groups
        if len(kept) >= cfg.prompts_per_step or not cfg.dynamic_sampling:
            break
    kept = kept[: cfg.prompts_per_step]
    metrics = {**group_metrics(seen, cfg), **reward_metrics, **timer.as_metrics(),
               **speculation_metrics(s for g in seen for s in g.samples),
               **domain_metrics(seen), **ctl.prompts.metrics()}
    if episodes := [t for g in seen for t in g.trajectories]:
        metrics |= agent_metrics(episodes)
    samples = [s for gid, g in enumerate(kept) for s in g.to_samples(cfg, gid)]
    if cfg.routing_replay:  # the share of samples the update replays the engine's routing for
        metrics["rollout/routed_samples"] = (
            sum(s.routed_experts is not None for s in samples) / len(samples) if samples else 0.0)
    return Batch(samples, metrics)


def _share(batch: Batch | None) -> Batch:
    """The controller's batch on every trainer rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert batch is not None
        return batch
    box = [batch]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def drop_stale(batch: Batch, version: int, max_staleness: int) -> Batch:
    """Keep what was sampled at most `max_staleness` weight versions behind `version`.

    Per token: a sample whose generation spanned a weight update (partial rollouts,
    `token_versions`) keeps its fresh tokens and has its stale ones masked out of the
    loss; a sample with no fresh token left is dropped. The importance correction then
    weighs every kept token by its own rollout logprob, which the version that sampled
    it reported.
    """
    fresh: list[RLSample] = []
    masked = spanning = 0
    collected_ages, trained_ages = [0], [0]
    for s in batch.samples:
        versions = (s.token_versions if s.token_versions is not None
                    else torch.full((s.completion_ids.numel(),), s.weight_version))
        spanning += int(versions.min() != versions.max())
        collected_ages.append(version - int(versions.min()))
        keep = version - versions <= max_staleness
        mask = keep.float() if s.loss_mask is None else s.loss_mask * keep
        if not bool(mask.any()):
            continue
        masked += int((~keep).sum())
        trained_ages.append(version - int(versions[mask.bool()].min()))
        fresh.append(s if bool(keep.all()) else replace(s, loss_mask=mask))
    metrics = {
        **batch.metrics,
        "async/dropped_stale": float(len(batch.samples) - len(fresh)),
        "async/staleness_max_collected": float(max(collected_ages)),
        "async/staleness_max_trained": float(max(trained_ages)),
        "async/spanning_versions": float(spanning),
        "async/masked_stale_tokens": float(masked),
    }
    return Batch(fresh, metrics)


def update(cfg: RLConfig, peers: Peers, samples: Sequence[RLSample],
           num_minibatches: int = 1) -> dict[str, float]:
    """One step's training on `samples` (the same list on every rank), split into
    `num_minibatches` minibatches, in this order:

    1. every minibatch packed, with pi_old (the policy's) and the reference's
       logprobs, before any weight moves;
    2. with a critic (`rl.advantage=gae`): its values of every micro-batch, before it
       moves; GAE advantages and value targets over the whole step; one critic step per
       minibatch. `rl.advantage=reinforce_pp`: its advantages over the whole step;
    3. one policy step per minibatch, except during the critic's warm-up (its first
       `rl.critic.warmup_steps` updates).

    Metrics: the policy's, averaged over its steps (maxima: the largest), then the
    advantages' and the critic's."""
    if len(samples) < num_minibatches:
        raise ValueError(f"{len(samples)} samples cannot make {num_minibatches} minibatches")
    size = -(-len(samples) // num_minibatches)
    parts = [samples[i : i + size] for i in range(0, len(samples), size)]
    prepared = [peers.prepare(part, first=i == 0) for i, part in enumerate(parts)]
    extra: dict[str, float] = {}
    moves = True
    if cfg.advantage == "reinforce_pp":
        dp_group = peers.policy.groups.dp_group
        prepared, extra = reinforce_pp_step(prepared, cfg.kl_in_reward, dp_group)
    elif cfg.advantage == "gae":
        critic, dp_group = peers.need_critic(), peers.policy.groups.dp_group
        # values (V_old, before the critic moves) -> advantages -> critic update
        values = [critic.values(p.micro) for p in prepared]
        advantaged, returns, extra = gae_step(prepared, parts, values, cfg, dp_group)
        extra |= critic_steps(critic, prepared, values, returns)
        prepared = advantaged
        moves = peers.updates >= critic.cfg.warmup_steps
        extra["critic_warmup"] = float(not moves)
    # -> policy update
    metrics = peers.policy.update(prepared) if moves else sat_out(prepared)
    peers.updates += 1
    return {**metrics, **extra}


@dataclass(frozen=True)
class StepEnd:
    """What `on_step_end` learns after a step trained and its weights were pushed."""

    step: int
    prompts: dict[str, Any] | None
    """Controller only: the PromptStream state where the next step's prompts begin."""
    collected_ahead: int = 0
    """Async: batches already collected for later steps (a resume collects them again)."""


def run_steps(cfg: RLConfig, peers: Peers, sync: WeightSync, ctl: Controller | None,
              start_step: int = 0, on_step_end: Callable[[StepEnd], bool] | None = None,
              ) -> bool:
    """RL steps [start_step, cfg.steps). `ctl` is None on every rank but the controller.
    Each step trains `peers` (`update`) and pushes the policy's weights.

    The rollout servers must already serve the policy's current weights as version
    `start_step`. Evaluations run at step 0, every `eval_interval` steps and at the
    end, so a resumed run evaluates where an uninterrupted one would. When
    `on_step_end` returns True (a stop signal; the step is checkpointed) the run
    ends there, without the final evaluation, and `run_steps` returns True.
    """
    producer = _Producer(ctl, cfg, start_step) if cfg.mode == "async" and ctl else None
    for step in range(start_step, cfg.steps):
        if ctl is not None and ctl.held_out and (step == 0 or (cfg.eval_interval and
                                                               step % cfg.eval_interval == 0)):
            scores = _timed_evaluate(ctl, cfg, step)
            ctl.logger.log(step, scores)
            print(f"eval at step {step}: pass rate {scores.get('eval/pass_rate', 0):.3f}",
                  flush=True)
        started, mine = time.perf_counter(), None
        if ctl is not None:
            mine = producer.next() if producer else collect(ctl, cfg, step)
        batch = drop_stale(_share(mine), step, cfg.max_staleness)
        timer = StepTimer()
        with timer.phase("train"):
            metrics = (update(cfg, peers, batch.samples, cfg.updates_per_step)
                       if batch.samples else {})
        with timer.phase("sync"):
            sync.push(peers.policy, step + 1)
        if ctl is not None:
            row = {**batch.metrics, **{f"train/{k}": v for k, v in metrics.items()},
                   **timer.as_metrics(), "weights/version": float(step + 1),
                   "time/step": time.perf_counter() - started}
            streamed = getattr(sync, "streamed", None)  # rl.weight_sync=memory
            if streamed is not None:  # versions this process streamed, not sent by disk
                row["weights/streamed"] = float(streamed)
            ctl.logger.log(step, row)
            _print_step(step, cfg.steps, row)
        if on_step_end is not None and on_step_end(_step_end(step, ctl, producer)):
            if producer:
                producer.stop()
            return True
    if producer:
        producer.stop()
    if ctl is not None and ctl.held_out:  # agent tasks have no held-out prompts
        ctl.logger.log(cfg.steps, _timed_evaluate(ctl, cfg, cfg.steps))
    return False


def _timed_evaluate(ctl: Controller, cfg: RLConfig, step: int) -> dict[str, float]:
    """The held-out scores and `time/eval`, the evaluation's seconds (a step's
    `time/step` does not include them)."""
    started = time.perf_counter()
    scores = evaluate(ctl.generation(), cfg, ctl.held_out, step)
    return {**scores, "time/eval": time.perf_counter() - started}


def _step_end(step: int, ctl: Controller | None, producer: _Producer | None) -> StepEnd:
    if ctl is None:
        return StepEnd(step, None)
    if producer is None:  # sync: the stream stands where step + 1 will take from
        return StepEnd(step, ctl.prompts.state())
    return producer.step_end(step, ctl)


_SHOWN = (("reward/mean", "reward"), ("reward/pass_rate", "pass"), ("train/kl_ref", "kl"),
          ("train/clip_frac", "clip"), ("rollout/response_length", "len"),
          ("time/rollout", "gen s"), ("time/reward", "reward s"), ("time/train", "train s"))


def _print_step(step: int, steps: int, row: dict[str, float]) -> None:
    shown = "  ".join(f"{label} {row[key]:.3f}" for key, label in _SHOWN if key in row)
    print(f"RL step {step + 1}/{steps}  {shown}", flush=True)


class _Producer:
    """Async mode: collects the next steps' batches while the current one trains.

    A batch is only started while fewer than `max_staleness` finished batches wait
    (a slot is taken before collecting and given back when the trainer takes the
    batch), so a batch collected under weights v is trained at step <= v +
    max_staleness; `drop_stale` enforces the bound per sample regardless.
    """

    def __init__(self, ctl: Controller, cfg: RLConfig, start_step: int) -> None:
        self.queue: queue.Queue[Batch | BaseException] = queue.Queue()
        self.slots = threading.Semaphore(max(cfg.max_staleness, 1))
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.starts: dict[int, dict[str, Any]] = {}  # step -> stream state before collecting it
        self.thread = threading.Thread(target=self._run, args=(ctl, cfg, start_step),
                                       name="rl-producer", daemon=True)
        self.thread.start()

    def _run(self, ctl: Controller, cfg: RLConfig, start_step: int) -> None:
        try:
            for step in range(start_step, cfg.steps):
                self.slots.acquire()
                if self.stopping.is_set():
                    return
                with self.lock:
                    self.starts[step] = ctl.prompts.state()
                self.queue.put(collect(ctl, cfg, step))
        except BaseException as err:  # surfaced in the training thread
            self.queue.put(err)

    def next(self) -> Batch:
        item = self.queue.get()
        self.slots.release()
        if isinstance(item, BaseException):
            raise RuntimeError(f"rollout collection failed: {item}") from item
        return item

    def step_end(self, step: int, ctl: Controller) -> StepEnd:
        """Where step + 1's prompts begin, although later batches may be collected
        (or being collected) already: the stream state recorded before each collect."""
        with self.lock:
            for done in [k for k in self.starts if k <= step]:
                del self.starts[done]
            # Not started yet: nothing has moved the stream past step + 1's start.
            prompts = self.starts.get(step + 1) or ctl.prompts.state()
            return StepEnd(step, prompts, collected_ahead=len(self.starts))

    def stop(self) -> None:
        self.stopping.set()
        self.slots.release()
