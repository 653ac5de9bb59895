"""`moerl train-lm`: a language-model training run on the synthetic corpus."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from moerl.checkpoint.config import CheckpointConfig
from moerl.config import apply_model_from, compose
from moerl.data.tokenizer import TokenizerConfig
from moerl.models.arch import MoEArch
from moerl.models.precision import PrecisionConfig, RecomputeConfig
from moerl.parallel.layout import ParallelLayout
from moerl.rendezvous import request_requeue
from moerl.trainer.config import OptimConfig
from moerl.typed_config import ConfigError, from_dict


@dataclass
class LMTrainConfig:
    steps: int = 30
    global_batch: int = 8
    micro_batch: int = 2
    seq_length: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.steps, self.global_batch, self.micro_batch, self.seq_length) < 1:
            raise ValueError("train: steps, global_batch, micro_batch, seq_length must be >= 1")
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"train.global_batch: {self.global_batch} is not a multiple of "
                f"train.micro_batch ({self.micro_batch})"
            )


@dataclass
class LMRunConfig:
    model: MoEArch
    parallel: ParallelLayout
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: LMTrainConfig = field(default_factory=LMTrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)


def layout_for_world(raw: dict[str, Any]) -> ParallelLayout:
    """The `parallel` group as a layout, with dp derived from the ranks started unless set."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if raw.get("dp") is not None:
        return from_dict(ParallelLayout, raw, "parallel")
    degrees = {k: v for k, v in raw.items() if k != "dp"}
    layout = from_dict(ParallelLayout, degrees, "parallel")
    return ParallelLayout.for_world(world, **vars(layout))


def check_layout_at_start(arch: MoEArch, layout: ParallelLayout, world: int | None = None) -> None:
    """Every layout rule, before any process group or model exists."""
    import torch

    from moerl.models.features import te_available

    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    layout.check(arch, world, backend, te_available())


def check_precision_at_start(precision: PrecisionConfig, recompute: RecomputeConfig) -> None:
    """The precision and recompute settings against this machine (a GPU, Transformer
    Engine), before any process group or model exists."""
    from moerl.models.features import resolve_precision

    try:
        recompute.check(precision, te=resolve_precision(precision).te)
    except ValueError as err:  # PrecisionUnavailable included; the message names the field
        raise ConfigError(str(err)) from err


def check_tokenizer_at_start(tokenizer: TokenizerConfig, model_vocab_size: int) -> None:
    """The tokenizer loads and fits the model's vocabulary, before any stage starts."""
    from moerl.data.tokenizer_build import build_tokenizer

    try:
        build_tokenizer(tokenizer, model_vocab_size)
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from err


class _WithLayout(Protocol):
    model: MoEArch
    parallel: ParallelLayout
    precision: PrecisionConfig
    recompute: RecomputeConfig


def load_with_layout[C: _WithLayout](overrides: list[str], config_name: str,
                                     schema: type[C]) -> C:
    """configs/<config_name>.yaml as `schema`, its layout derived and checked at start."""
    data = compose(overrides, config_name=config_name, schema=schema)
    apply_model_from(data)
    layout = layout_for_world(data.pop("parallel"))
    cfg = from_dict(schema, {**data, "parallel": {}}, "")
    cfg.parallel = layout
    check_layout_at_start(cfg.model, layout)
    check_precision_at_start(cfg.precision, cfg.recompute)
    return cfg


def load_lm_config(overrides: list[str]) -> LMRunConfig:
    cfg = load_with_layout(overrides, "lm", LMRunConfig)
    layout = cfg.parallel
    per_step = cfg.train.micro_batch * layout.dp
    if cfg.train.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch: {cfg.train.global_batch} is not a multiple of "
            f"micro_batch * dp = {per_step}"
        )
    return cfg


def run_lm(overrides: list[str]) -> int:
    from moerl.trainer.lm import train_lm

    cfg = load_lm_config(overrides)
    run = train_lm(
        cfg.model, cfg.parallel, cfg.optim, cfg.train.steps, cfg.train.global_batch,
        cfg.train.micro_batch, cfg.train.seq_length, seed=cfg.train.seed,
        checkpoint=cfg.checkpoint, precision=cfg.precision, recompute=cfg.recompute,
    )
    losses = run.losses
    if int(os.environ.get("RANK", "0")) == 0 and losses:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    return request_requeue() if run.stopped else 0
