"""`moerl` command line: one sub-command per program, Hydra overrides after it.

    moerl demo                               the default post-training demo (tiny MoE, CPU)
    moerl train experiment=demo rl.steps=60  an RL run (stages as local processes or SLURM)
    moerl sft sft.pack=true sft.data_path=x.jsonl  supervised fine-tuning (torchrun-aware)
    moerl nemo +experiment=demo launcher=slurm  the run as nemo-run would submit it (dry run)
    moerl model-info model=kimi-k2 [--json]  parameters and training FLOPs per token
    moerl plan model=kimi-k2 cluster.nodes=160 rollout.nodes=32 [--json]
    moerl rehearse +experiment=kimi_k2_h100  every distinct rank of a recipe at its real size
    moerl train-lm parallel.tp=2 ...         a language-model training run (torchrun-aware)
    moerl serve reward --port 8100           the reward server
    moerl hf import HF_DIR WEIGHTS_DIR       Hugging Face -> Megatron (and `hf export`)
    moerl eval agent --policy scripted       the shipped terminal tasks (or --rendezvous DIR)

Sub-commands import their module only when run, so `moerl --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from moerl.checkpoint.config import CheckpointError
from moerl.models.arch import ArchError
from moerl.parallel.layout import LayoutError
from moerl.typed_config import ConfigError


def _si(value: float) -> str:
    """1234567 -> '1.23 M'."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} "


def _model_info(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from moerl.config import load_model_config
    from moerl.models.count import model_counts

    arch, seq_length = load_model_config(overrides)
    counts = model_counts(arch, seq_length=seq_length)
    if args.json:
        print(json.dumps({"model": arch.name, "seq_length": seq_length, **counts.as_dict()}))
        return 0
    table = Table(title=f"{arch.name} (sequence length {seq_length})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("total parameters", _si(counts.total_params))
    table.add_row("active parameters per token", _si(counts.active_params))
    table.add_row("MTP parameters (not in total)", _si(counts.mtp_params))
    table.add_row("training FLOPs per token", _si(counts.train_flops_per_token) + "FLOP")
    Console().print(table)
    return 0


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.launchers.plan_cli import plan_main

    return plan_main(overrides, as_json=args.json, recipe=args.recipe)


def _rehearse(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.launchers.rehearse import rehearse_main

    return rehearse_main(overrides, only=args.only, busiest=args.busiest)


def _train_lm(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.launchers.lm import run_lm

    return run_lm(overrides)


def _demo(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.launchers.run import launch_run

    return launch_run(["+experiment=demo", *overrides], dry_run=args.dry_run)


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.launchers.run import launch_run

    return launch_run(overrides, dry_run=args.dry_run)


def _sft(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.data.sft import SFTDataError
    from moerl.launchers.sft import run_sft_command

    try:
        return run_sft_command(overrides)
    except SFTDataError as err:
        print(f"moerl sft: data error: {err}", file=sys.stderr)
        return 2


def _nemo(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.launchers.nemo import nemo_main

    return nemo_main(overrides)


def _trainer(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.launchers.run import run_trainer_stage

    return run_trainer_stage(overrides)


def _hf(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.launchers.hf_cli import hf_main

    return hf_main([args.direction, *overrides])


def _serve(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.service == "reward":
        from moerl.rewards.server import main as serve_reward

        return serve_reward(overrides)
    if args.service == "env":
        from moerl.agent.env_server import main as serve_env

        return serve_env(overrides)
    from moerl.rollout.server import main as serve_rollout

    return serve_rollout(overrides)


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from moerl.agent.evaluate import main as eval_agent

    return eval_agent(args.options)


Handler = Callable[[argparse.Namespace, list[str]], int]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moerl",
        description="RL post-training of Mixture-of-Experts models on Megatron-Core.",
        epilog="Arguments after the sub-command are Hydra overrides, e.g. parallel.tp=2.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the default post-training demo: SFT then GRPO, tiny MoE")
    demo.add_argument("--dry-run", action="store_true",
                      help="print what would start (SLURM script or local commands), start nothing")
    demo.set_defaults(handler=_demo)
    train = sub.add_parser("train", help="an RL run: reward and rollout servers, trainer")
    train.add_argument("--dry-run", action="store_true",
                       help="print the sbatch script (launcher=slurm) or the local stage "
                       "commands; start and submit nothing")
    train.set_defaults(handler=_train)
    sft = sub.add_parser("sft", help="supervised fine-tuning; its weights start an RL run")
    sft.set_defaults(handler=_sft)
    nemo = sub.add_parser("nemo", help="print the run as nemo-run would submit it (dry run)")
    nemo.set_defaults(handler=_nemo)
    trainer = sub.add_parser("trainer", help="the trainer stage of a run (started by train)")
    trainer.set_defaults(handler=_trainer)
    info = sub.add_parser("model-info", help="parameter counts and training FLOPs")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(handler=_model_info)
    plan = sub.add_parser("plan", help="choose a parallel layout for a model on a cluster")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--recipe", type=Path, default=None, metavar="PATH",
                      help="also write the best layout as a recipe "
                           "(configs/experiment/NAME.yaml; slurm/ via moerl.launchers.recipes)")
    plan.set_defaults(handler=_plan)
    rehearse = sub.add_parser(
        "rehearse", help="build every distinct rank of a recipe at its real size, on tensors "
                         "that hold no memory, and check it against the plan and its GPU")
    rehearse.add_argument("--only", choices=["trainer", "rollout"], default=None,
                          help="rehearse one stage's ranks")
    rehearse.add_argument("--busiest", action="store_true",
                          help="of the trainer, only the pipeline stage the planner finds "
                               "most loaded")
    rehearse.set_defaults(handler=_rehearse)
    lm = sub.add_parser("train-lm", help="language-model training on the synthetic corpus")
    lm.set_defaults(handler=_train_lm)
    hf = sub.add_parser("hf", help="Hugging Face checkpoints <-> Megatron weights",
                        description="moerl hf import <hf_dir> <weights_dir> [tp=2 ep=2 ...]\n"
                        "moerl hf export <weights_dir> <hf_out_dir> [model=...]")
    hf.add_argument("direction", choices=["import", "export"])
    hf.set_defaults(handler=_hf)
    serve = sub.add_parser("serve", help="run a rollout or reward server")
    serve.add_argument("service", choices=["reward", "rollout", "env"])
    serve.set_defaults(handler=_serve)
    evaluate = sub.add_parser("eval", help="evaluate a policy: `moerl eval agent --help`",
                              add_help=False)
    evaluate.add_argument("target", choices=["agent"])
    evaluate.add_argument("options", nargs=argparse.REMAINDER)
    evaluate.set_defaults(handler=_eval)
    return parser


def _quiet_expected_warnings() -> None:
    """Megatron announces at import that TE and Apex are absent: expected on CPU, and
    it drowns the run's own output. Warnings from the project itself stay on."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    for module in ("megatron", "torch"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)


def main(argv: list[str] | None = None) -> int:
    _quiet_expected_warnings()
    args, overrides = _parser().parse_known_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args, overrides)
    except (ConfigError, ArchError, LayoutError) as err:
        print(f"moerl {args.command}: configuration error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # refused resume, unreadable or tampered checkpoint
        print(f"moerl {args.command}: checkpoint error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
