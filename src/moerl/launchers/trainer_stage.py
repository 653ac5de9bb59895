"""The trainer stage of a run: SFT warm-up (optional), then RL against the servers.

Every trainer rank runs `trainer_main`; global rank 0 is also the controller that
talks to the rollout and reward servers (found in the rendezvous directory).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moerl.checkpoint.collective import barrier
from moerl.checkpoint.config import Fingerprints
from moerl.config import RunConfig
from moerl.data.chat import encode_prompt
from moerl.data.mixture import MixtureStream
from moerl.data.prompt_sources import load_prompts
from moerl.data.prompts import PromptRecord, PromptStream
from moerl.data.sft import instruction_examples
from moerl.data.tokenizer import Tokenizer
from moerl.data.tokenizer_build import build_tokenizer
from moerl.launchers.domain_report import check_reward_names, domain_plot, domain_table
from moerl.launchers.plan import RunLayout
from moerl.models.features import resolve_precision
from moerl.models.precision import RecomputeConfig, ResolvedPrecision
from moerl.models.weights import save_weights
from moerl.models.weights_marker import is_complete
from moerl.observability import MetricsLogger, read_metrics
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.rendezvous import ENV_RENDEZVOUS, read_endpoints, request_requeue
from moerl.rewards.client import RewardClient
from moerl.rl.agent_collect import (
    EPISODE,
    agent_task_records,
    build_agent_collector,
    terminal_source,
)
from moerl.rl.domains import domain_runs
from moerl.rl.loop import Controller, run_steps
from moerl.rl.peers import Peers
from moerl.rl.resume import RLCheckpoints
from moerl.rl.weight_sync_build import build_weight_sync
from moerl.rollout.client import RolloutClient
from moerl.signals import STOP_SIGNALS, StopOnSignal, start_helpers_ignoring
from moerl.trainer.sft import build_sft_trainable, run_sft
from moerl.typed_config import to_dict


def sft_phase(cfg: RunConfig, groups: ParallelGroups, tok: Tokenizer,
              records: list[PromptRecord], out: Path) -> Path:
    """SFT from `init_weights` (or a fresh model) on `sft.data_path` or the records'
    reference completions; its weights dir."""
    examples = instruction_examples(tok, cfg.sft.data_path, records)
    trainable = build_sft_trainable(cfg.model, cfg.parallel, cfg.sft, groups, cfg.init_weights,
                                    resolve_precision(cfg.precision), cfg.recompute)
    losses = run_sft(trainable, groups, examples, cfg.sft, tok.pad_id)
    if groups.is_logging_rank:
        Console().print(f"SFT: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    if groups.rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    return save_weights(list(trainable.model), out)


def _controller(cfg: RunConfig, root: Path, records: list[PromptRecord],
                held_out: list[PromptRecord], tok: Tokenizer) -> Controller:
    rendezvous = Path(os.environ.get(ENV_RENDEZVOUS, root / "rendezvous"))
    rollout_client = RolloutClient(rendezvous_dir=rendezvous, config=cfg.rollout.client,
                            engine=cfg.rollout.engine)
    reward_client = RewardClient(cfg.rewards.client, rendezvous_dir=rendezvous, seed=cfg.rl.seed)
    data = cfg.data
    prompts: PromptStream | MixtureStream = (
        MixtureStream.of(records, data.mixture, data.seed, cfg.rl.difficulty_filter_epochs)
        if data.source == "mixture" else
        PromptStream(records, seed=data.seed, set_aside_epochs=cfg.rl.difficulty_filter_epochs))
    return Controller(
        rollout_client=rollout_client, reward_client=reward_client, prompts=prompts,
        held_out=held_out,
        runs=domain_runs({k: data.domains[k] for k in data.mixture}, cfg.rl),
        encode=lambda record: encode_prompt(tok, record.prompt, record.messages),
        stop_token_ids=tok.stop_ids,
        logger=MetricsLogger(cfg.logger, root, to_dict(cfg)),
    )


def _environment_servers(cfg: RunConfig, root: Path) -> list[str]:
    """The environment servers the launcher started (`environments.servers` of them);
    none with `environments.servers=0`: the episodes then run in this process."""
    if cfg.environments.servers == 0:
        return []
    rendezvous = Path(os.environ.get(ENV_RENDEZVOUS, root / "rendezvous"))
    found = read_endpoints(rendezvous, "environment")
    if len(found) < cfg.environments.servers:
        raise RuntimeError(
            f"environments.servers={cfg.environments.servers}, but {len(found)} environment "
            f"servers announced themselves in {rendezvous}; start them (`moerl serve env`) "
            "or set environments.servers=0 to run the episodes in the trainer")
    return found[: cfg.environments.servers]


def summary_table(metrics_file: Path) -> Table:
    """Held-out pass rate before RL (after SFT) and after RL."""
    evals = [r for r in read_metrics(metrics_file) if "eval/pass_rate" in r]
    table = Table(title="held-out evaluation (greedy)")
    for column in ("", "step", "pass rate", "mean reward"):
        table.add_column(column)
    for label, row in (("before RL", evals[0]), ("after RL", evals[-1])) if evals else ():
        table.add_row(label, str(int(row["step"])), f"{row['eval/pass_rate']:.3f}",
                      f"{row['eval/mean_reward']:.3f}")
    return table


def _checkpoints(cfg: RunConfig, records: list[PromptRecord], held_out: list[PromptRecord],
                 start: str | Path | None) -> RLCheckpoints | None:
    """The run's checkpoints; a resume is refused when the model or the data changed.
    `start`: the weights a fresh start's policy (and reference) are read from."""
    if not cfg.checkpoint.enabled:
        return None
    data = {"train": records, "held_out": held_out, "order_seed": cfg.data.seed}
    run = {"rl": cfg.rl, "optim": cfg.optim, "sft": cfg.sft}  # recorded, may change
    return RLCheckpoints(cfg.checkpoint, Fingerprints.of(cfg.model, data, run), start,
                         seed=cfg.rl.seed, layout=cfg.parallel.describe())


def _first_version(ckpt: RLCheckpoints | None, start: str | Path | None) -> Path | None:
    """The weights directory the servers' first version already is: the resumed
    checkpoint's model part, or the weights a fresh start read (None: a fresh model,
    which exists nowhere on disk)."""
    found = ckpt.found() if ckpt is not None else None
    if found is not None:
        return found / "dist" if is_complete(found / "dist") else None
    return Path(start) if start is not None else None


def trainer_main(cfg: RunConfig, dirs: RunLayout) -> int:
    """SFT (unless resuming), then RL. With checkpoints, SIGTERM/SIGUSR1 (even during
    set-up) end the run after the next RL step: checkpoint, then the requeue code."""
    groups = init_parallel(cfg.parallel, seed=cfg.rl.seed)
    try:
        with StopOnSignal(STOP_SIGNALS if cfg.checkpoint.enabled else ()) as stop:
            start_helpers_ignoring()  # now, so that its start-up overlaps SFT
            stopped = _run(cfg, dirs, groups, stop)
        return request_requeue() if stopped else 0
    finally:
        destroy_parallel()


def build_peers(cfg: RunConfig, groups: ParallelGroups, weights: str | Path | None,
                reference_weights: str | Path | None, precision: ResolvedPrecision,
                recompute: RecomputeConfig) -> Peers:
    """The policy, its reference and, with `rl.advantage=gae`, PPO's critic: what every
    trainer rank builds (also `moerl rehearse`, on a fake rank). A resume then loads the
    policy and the critic from the checkpoint."""
    return Peers.build(cfg.model, cfg.parallel, cfg.optim, groups, cfg.rl, weights=weights,
                       reference_weights=reference_weights, precision=precision,
                       recompute=recompute)


def _run(cfg: RunConfig, dirs: RunLayout, groups: ParallelGroups, stop: StopOnSignal) -> bool:
    """True when a stop signal ended the run (checkpointed) before its last step."""
    tok = build_tokenizer(cfg.tokenizer, cfg.model.vocab_size)
    records, held_out, _ = load_prompts(
        cfg.data, {"terminal": terminal_source(cfg.rl.agent)},
        tokens=lambda record: len(encode_prompt(tok, record.prompt, record.messages)))
    check_reward_names(records + held_out, cfg.rewards)
    start = dirs.sft_weights if cfg.sft.steps else cfg.init_weights
    ckpt = _checkpoints(cfg, records, held_out, start)
    # A checkpoint holds the policy after SFT and RL: no SFT again on resume, and the
    # policy's weights are read from the checkpoint alone. The reference model is read
    # where the run's initial weights are (nothing is copied at start-up).
    resuming = ckpt is not None and ckpt.found() is not None
    if cfg.sft.steps and not resuming:
        sft_phase(cfg, groups, tok, records, dirs.sft_weights)
    peers = build_peers(cfg, groups, None if resuming else start,
                        ckpt.reference_weights() if ckpt else None,
                        resolve_precision(cfg.precision), cfg.recompute)
    state = ckpt.load(peers) if ckpt else None
    first = state.next_step if state else 0
    ctl = None
    if groups.rank == 0:
        agent = cfg.rl.task_source == "agent"
        # rl.task_source=agent: the selected terminal tasks are the RL prompts (the data
        # group's prompts are SFT's, and its held-out ones are code tasks, not agent tasks)
        ctl = (_controller(cfg, dirs.root, agent_task_records(cfg.rl.agent), [], tok) if agent
               else _controller(cfg, dirs.root, records, held_out, tok))
        if state is not None:
            ctl.prompts.restore(state.prompts, strict=not cfg.checkpoint.allow_changed_data)
        ctl.logger.drop_from(first)  # rows a killed attempt logged after its checkpoint
        if agent or any(r.reward == EPISODE for r in records):  # episodes, in this round
            ctl.episodes = build_agent_collector(
                cfg.rl, cfg.model.max_position_embeddings, tok,
                environment_servers=_environment_servers(cfg, dirs.root))
    if groups.rank == 0:  # versions an earlier attempt published are stale
        shutil.rmtree(dirs.weights, ignore_errors=True)
    barrier()
    # moerl servers load Megatron weights; vllm/sglang an HF export of them.
    sync = build_weight_sync(cfg.rollout.engine, dirs.weights,
                             ctl.rollout_client if ctl else None,
                             keep=cfg.rl.keep_weight_versions,
                             hf_model_dir=cfg.rollout.hf_model_dir, dtype=cfg.rollout.dtype,
                             mode=cfg.rl.weight_sync, arch=peers.policy.arch,
                             staging_bytes=cfg.rl.weight_sync_staging_bytes,
                             timeout_s=cfg.rl.weight_sync_timeout_s,
                             server_ranks=cfg.rollout.tensor_parallel
                             * cfg.rollout.pipeline_parallel,
                             initial=_first_version(ckpt, start))
    sync.push(peers.policy, first)  # the servers start from the trainer's (resumed) weights
    on_step_end = ckpt.step_end_hook(peers, stop, cfg.rl.steps) if ckpt else None
    stopped = run_steps(cfg.rl, peers, sync, ctl, start_step=first, on_step_end=on_step_end)
    if ckpt is not None:
        ckpt.close()
    if stopped:
        return True
    if ctl is not None:
        plot = ctl.logger.close(("reward/mean", "eval/pass_rate"))
        Console().print(summary_table(ctl.logger.path))
        plots = [p for p in (plot, domain_plot(ctl.logger.path, dirs.root)) if p]
        if cfg.data.source == "mixture":
            Console().print(domain_table(ctl.logger.path))
        Console().print(f"metrics: {ctl.logger.path}"
                        + (f"  plots: {', '.join(map(str, plots))}" if plots else ""))
    return False
