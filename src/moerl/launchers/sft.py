"""`moerl sft`: supervised fine-tuning as a run of its own.

The same model, layout and SFT code as the warm-up of `moerl train`; it writes
`<out_dir>/weights` (layout-independent), which `moerl train init_weights=...`
starts RL from. Checkpointed like `moerl train-lm`: killed or requeued, the same
command continues at the saved step (batches are a function of the step).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from moerl.checkpoint.config import CheckpointConfig
from moerl.config import check_init_weights
from moerl.data.prompts import DataConfig
from moerl.data.tokenizer import TokenizerConfig
from moerl.launchers.lm import check_tokenizer_at_start, load_with_layout
from moerl.models.arch import MoEArch
from moerl.models.precision import PrecisionConfig, RecomputeConfig
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.config import SFTConfig
from moerl.typed_config import ConfigError


@dataclass
class SFTRunConfig:
    model: MoEArch
    parallel: ParallelLayout
    sft: SFTConfig
    data: DataConfig = field(default_factory=DataConfig)
    out_dir: str = "runs/sft"
    init_weights: str | None = None
    model_from: str | None = None  # a `moerl hf import` dir whose model.json replaces `model`
    seed: int = 0
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def __post_init__(self) -> None:
        if self.sft.steps < 1:
            raise ConfigError("sft.steps: `moerl sft` needs at least one step (e.g. sft.steps=200)")
        check_init_weights(self.init_weights)


def load_sft_config(overrides: list[str]) -> SFTRunConfig:
    cfg = load_with_layout(overrides, "sft_run", SFTRunConfig)
    check_tokenizer_at_start(cfg.tokenizer, cfg.model.vocab_size)
    try:
        cfg.sft.check_layout(cfg.parallel, cfg.model.mtp_num_layers)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return cfg


def run_sft_command(overrides: list[str]) -> int:
    from rich.console import Console

    from moerl.checkpoint.checkpointer import Checkpointer
    from moerl.checkpoint.config import Fingerprints
    from moerl.data.prompt_sources import load_prompts
    from moerl.data.sft import instruction_examples
    from moerl.data.tokenizer_build import build_tokenizer
    from moerl.models.features import resolve_precision
    from moerl.models.weights import save_weights
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.rendezvous import request_requeue
    from moerl.signals import STOP_SIGNALS, StopOnSignal, start_helpers_ignoring
    from moerl.trainer.sft import build_sft_trainable, run_sft, sft_optim
    from moerl.trainer.step import StepMetrics

    cfg = load_sft_config(overrides)
    out = Path(cfg.out_dir).resolve()
    tok = build_tokenizer(cfg.tokenizer, cfg.model.vocab_size)
    records = load_prompts(cfg.data)[0] if cfg.sft.data_path is None else []
    examples = instruction_examples(tok, cfg.sft.data_path, records)
    groups = init_parallel(cfg.parallel, seed=cfg.seed)
    try:
        trainable = build_sft_trainable(cfg.model, cfg.parallel, cfg.sft, groups, cfg.init_weights,
                                        resolve_precision(cfg.precision), cfg.recompute)
        ckpt = None
        if cfg.checkpoint.enabled:
            run = {"sft": cfg.sft, "optim": sft_optim(cfg.sft), "init": cfg.init_weights}
            ckpt = Checkpointer(cfg.checkpoint, Fingerprints.of(cfg.model, examples, run))
        resumed = ckpt.load(trainable, require=("data",)) if ckpt else None
        start = resumed.step if resumed else 0
        stopped = False
        with StopOnSignal(STOP_SIGNALS if ckpt else ()) as stop:
            start_helpers_ignoring()  # now, so that its start-up overlaps training
            def after(step: int, metrics: StepMetrics) -> bool:
                nonlocal stopped
                if ckpt is not None:
                    done = step + 1
                    stopped = ckpt.end_of_step(done, trainable, {"data": {"next_step": done}},
                                               stop, done == cfg.sft.steps)
                return stopped

            losses = run_sft(trainable, groups, examples, cfg.sft, tok.pad_id, on_step=after,
                             start_step=start)
        if ckpt is not None:
            ckpt.close()
        if stopped:  # checkpointed on SIGTERM/SIGUSR1: the same command continues
            return request_requeue()
        weights = out / "weights"
        if groups.rank == 0:
            shutil.rmtree(weights, ignore_errors=True)
        save_weights(list(trainable.model), weights)
        if groups.is_logging_rank:
            console = Console()
            if losses:
                console.print(f"SFT: loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps "
                              f"{start}..{cfg.sft.steps - 1}")
            console.print(f"weights: {weights}\nstart RL from them: moerl train "
                          f"init_weights={weights}", soft_wrap=True)
        return 0
    finally:
        destroy_parallel()
