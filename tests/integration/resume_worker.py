"""One run for the resume tests: `train_lm` of the tiny MoE with checkpointing.

    python resume_worker.py train --steps 6 --ckpt '{"dir": ...}' [--layout '{"tp": 2}']
    python resume_worker.py probe --ckpt '{...}' --cases '[{...}, ...]'

`train` writes the losses of the steps it ran to --out (rank 0). `probe` builds
the model once and tries one `Checkpointer.load` per case, recording the error
(or the losses of the case's "steps" steps after the load, 1 by default) for each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from moerl.checkpoint.checkpointer import Checkpointer
from moerl.checkpoint.config import CheckpointConfig, CheckpointError, Fingerprints
from moerl.data.synthetic import SyntheticCorpus
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rendezvous import request_requeue
from moerl.trainer.config import OptimConfig
from moerl.trainer.lm import LMRun, batch_iterators, train_lm
from moerl.trainer.optimizer import build_optimizer
from moerl.trainer.step import train_step

OPTIM = OptimConfig(lr=1e-2)
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 32


def _layout(raw: str) -> ParallelLayout:
    return ParallelLayout.for_world(int(os.environ.get("WORLD_SIZE", "1")), **json.loads(raw))


def train(args: argparse.Namespace) -> LMRun:
    cfg = CheckpointConfig(**json.loads(args.ckpt)) if args.ckpt else None
    return train_lm(TINY, _layout(args.layout), OPTIM, args.steps, GLOBAL_BATCH, MICRO_BATCH,
                    SEQ, seed=args.seed, progress=True, checkpoint=cfg)


def probe(args: argparse.Namespace) -> Any:
    """Each case: {"ckpt": {...}, "seed": s, "arch": {...}}; result: error text or loss."""
    layout = _layout(args.layout)
    groups = init_parallel(layout, seed=args.seed)
    trainable = build_optimizer(build_model(TINY, layout), OPTIM, layout)
    results = []
    for case in json.loads(args.cases):
        arch = dataclasses.replace(TINY, **case.get("arch", {}))
        corpus = SyntheticCorpus(arch.vocab_size, SEQ, seed=case.get("seed", args.seed))
        run = (OPTIM, GLOBAL_BATCH, MICRO_BATCH)
        ckpt = Checkpointer(CheckpointConfig(**case["ckpt"]), Fingerprints.of(arch, corpus, run))
        try:
            resumed = ckpt.load(trainable, require=tuple(case.get("require", ["data"])))
        except CheckpointError as err:
            results.append({"error": str(err)})
            continue
        assert resumed is not None
        losses = []
        for step in range(resumed.step, resumed.step + case.get("steps", 1)):
            metrics = train_step(
                trainable.model,  # type: ignore[arg-type]
                trainable.optimizer,
                batch_iterators(corpus, step, groups, GLOBAL_BATCH, MICRO_BATCH),
                num_microbatches=GLOBAL_BATCH // (MICRO_BATCH * layout.dp),
                micro_batch_size=MICRO_BATCH, seq_length=SEQ, scheduler=trainable.scheduler,
            )
            losses.append(metrics.loss)
        results.append({"step": resumed.step, "loss": losses[0], "losses": losses})
    destroy_parallel()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "probe"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--layout", default="{}")
    parser.add_argument("--cases", default="[]")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode == "train":
        run = train(args)
        if run.stopped:  # checkpointed on a stop signal: exit as the entry points do
            sys.exit(request_requeue())
        result = run.losses
    else:
        result = probe(args)
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing Manager
    main()
