"""The shipped recipe scripts (slurm/*_h100.sbatch and the miniature's): in sync with
their recipes, accepted by a SLURM controller declaring an H100 cluster of the recipes'
size, and the miniature the same script as its recipe but for sizes."""

from __future__ import annotations

import dataclasses
import difflib
import re
import subprocess

import pytest

from moerl.launchers import recipes, slurm

STEMS = sorted([*recipes.RECIPES, *recipes.MINIATURES])


@pytest.mark.parametrize("stem", STEMS)
def test_script_in_sync(stem: str) -> None:
    text = recipes.render_recipe(stem)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert recipes.script_path(stem).read_text() == text, (
        "run `python -m moerl.launchers.recipes --write` to refresh"
    )


@pytest.mark.parametrize("stem", STEMS)
def test_trainer_gets_the_recipe_layout(stem: str) -> None:
    recipe = recipes.load_recipe(recipes.REPO / "configs" / "experiment" / f"{stem}.yaml")
    text = recipes.render_recipe(stem)
    for key in ("tp", "pp", "ep", "cp"):
        assert f"parallel.{key}={recipe.parallel[key]} " in text
    assert f"#SBATCH --nodes={recipe.trainer_nodes}\n" in text
    assert f"--nproc-per-node={recipe.gpus_per_node}" in text
    assert "#SBATCH --partition=cpu" in text and "--signal=B:USR1@600" in text


@pytest.mark.slurm
@pytest.mark.parametrize("stem", STEMS)
def test_controller_accepts_script(stem: str, slurm_cloud: dict[str, str]) -> None:
    verdict = slurm.test_only(recipes.script_path(stem).read_text(), env=slurm_cloud)
    assert "to start at" in verdict and "gpu[001-" in verdict, verdict


@pytest.mark.parametrize("stem", STEMS)
def test_trainer_and_rollout_run_the_plan_the_recipe_names(stem: str) -> None:
    """Field by field: the trainer's command line composes to the recipe's model,
    layout, sequence length, precision and recompute; the rollout servers compute in
    the trainer's precision; and the memory model, reading the composed run's fields,
    still finds the layout fits."""
    from moerl.models.arch import get_preset
    from moerl.planning.cost import ClusterSpec
    from moerl.planning.plan import SearchSettings, check_layout, judge
    from moerl.planning.run_fields import settings_of_run
    from moerl.rollout.server import _parse, precision_of

    recipe = recipes.load_recipe(recipes.REPO / "configs" / "experiment" / f"{stem}.yaml")
    trainer, rollout, *_ = recipes.run_plan(recipe, recipes.SHARED / "runs" / stem).stages
    argv = list(trainer.command)
    overrides = [a for a in argv[argv.index("trainer") + 1:] if not a.startswith("run_dir=")]
    cfg = recipes.compose_here(overrides)  # init_weights is a directory on the cluster
    assert cfg.model == get_preset(recipe.model)
    assert cfg.seq_length == recipe.seq_length
    for key, value in recipe.parallel.items():
        assert getattr(cfg.parallel, key) == value, key
    planned = settings_of_run(cfg.precision, cfg.recompute)
    assert (planned.precision, planned.layer_spec, planned.recompute) == (
        recipe.run.precision, recipe.run.layer_spec, recipe.run.recompute)
    served = [a.format(host="h", port=1) for a in rollout.command]
    args = _parse(served[served.index("rollout") + 1:])
    assert precision_of(args) == cfg.precision  # FP8 primary weights included
    run = dataclasses.replace(recipe.run, precision=planned.precision,
                              layer_spec=planned.layer_spec, recompute=planned.recompute)
    search = SearchSettings()
    uneven = check_layout(cfg.parallel, cfg.model, search)
    candidate = judge(cfg.model, cfg.parallel, run, ClusterSpec(nodes=recipe.trainer_nodes),
                      search, uneven)
    assert candidate.fits, candidate.reason


def _shape(stem: str) -> list[str]:
    """The rendered script with what may differ between a recipe and its miniature
    taken out: names, the precision the site computes in, the pipeline's virtual
    stages and uneven split (a toy model has neither), the settings of a run at scale
    (its `train` block: imported weights, the model's tokenizer, batch sizes; a
    miniature trains a fresh toy model on bytes) and every number."""
    from moerl.config import load_run_config
    from moerl.launchers.plan import rollout_precision_argv
    from moerl.planning.run_fields import run_overrides

    recipe = recipes.load_recipe(recipes.recipe_path(stem))
    text = recipes.render_recipe(stem)
    overrides = run_overrides(recipe.run)
    precision = load_run_config(overrides).precision
    for words in (" ".join(overrides), " ".join(rollout_precision_argv(precision))):
        text = text.replace(words, "PRECISION")
    if recipe.train:
        text = text.replace(" " + " ".join(recipes.train_overrides(recipe)), "")
    # The rollout's tokenizer flags; a token's text is quoted inside the step's bash -c '...'.
    quoted = r"'\"'\"'\S+?'\"'\"'"
    text = re.sub(rf" --tokenizer \S+( --tokenizer-kind \w+)?( --[a-z-]+-token ({quoted}|\w+))*",
                  "", text)
    for name in (recipes.script_name(stem), stem, recipe.model):
        text = text.replace(name, "NAME")
    text = re.sub(r" \S*parallel\.(vpp|stage_layers)=\S+", "", text)
    return re.sub(r"\d+", "N", text).splitlines()


@pytest.mark.parametrize("mini", sorted(recipes.MINIATURES))
def test_miniature_differs_from_its_recipe_only_in_sizes(mini: str) -> None:
    full = recipes.MINIATURES[mini]
    ours, theirs = _shape(mini), _shape(full)
    diff = "\n".join(difflib.unified_diff(theirs, ours, full, mini, lineterm=""))
    assert ours == theirs, diff


def test_engines_larger_than_a_node_span_whole_nodes() -> None:
    """Kimi-K2's rollout engines of 32 GPUs (TP8, EP32): one torchrun across 4 nodes of
    8 ranks each, 8 of them on the 32 rollout nodes; the trainer streams to them."""
    recipe = recipes.load_recipe(recipes.recipe_path("kimi_k2_h100"))
    _, rollout, *_ = recipes.run_plan(recipe, recipes.SHARED / "runs" / "k").stages
    assert (rollout.replicas, rollout.nodes, rollout.span, rollout.ranks_per_node) == (
        8, 32, 4, 8)
    text = recipes.render_recipe("kimi_k2_h100")
    (line,) = [x for x in text.splitlines() if "serve rollout" in x]
    assert "REPLICA=$((SLURM_NODEID / 4))" in line and "--nnodes=4" in line
    assert "--node-rank=$((SLURM_NODEID % 4)) --nproc-per-node=8" in line
    assert "--max-batch 24 --tp 8 --ep 32 --backend static" in line
    assert "--fp8 tensorwise --fp8-param --tokenizer /shared/moerl/weights/kimi-k2" in line
    assert "rl.weight_sync=memory" in text and "rollout.expert_parallel=32" in text
    assert "moerl_wait_announced rollout 8" in text
