"""The shipped recipe scripts (slurm/*_h100.sbatch): in sync with their recipes and
accepted by a SLURM controller declaring an H100 cluster of the recipes' size."""

from __future__ import annotations

import subprocess

import pytest

from moerl.launchers import recipes, slurm

STEMS = sorted(recipes.RECIPES)


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
