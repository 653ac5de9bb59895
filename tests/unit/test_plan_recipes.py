"""The shipped H100 recipes are `moerl plan --recipe` output: run again with the
command in its own header, the planner writes each file back unchanged (its
predictions, layout, precision, recompute and rollout engines, and the authors' notes
below the marker)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moerl.launchers.plan_cli import plan_main
from moerl.launchers.recipes import RECIPES, REPO
from moerl.planning.recipe import NOTES_MARKER


def _command(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Produced by:"))
    words = lines[start].removeprefix("# Produced by:").split()
    for line in lines[start + 1:]:
        if not line.startswith("#   "):
            break
        words += line.removeprefix("#").split()
    return words


@pytest.mark.parametrize("stem", sorted(RECIPES))
def test_recipe_is_what_the_planner_writes(stem: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    shipped = REPO / "configs" / "experiment" / f"{stem}.yaml"
    words = _command(shipped.read_text())
    assert words[:2] == ["moerl", "plan"] and words[-2] == "--recipe"
    assert words[-1] == f"configs/experiment/{stem}.yaml"
    target = tmp_path / words[-1]
    target.parent.mkdir(parents=True)
    shutil.copyfile(shipped, target)  # the notes come from the file being rewritten
    assert plan_main(words[2:-2], as_json=False, recipe=target) == 0
    capsys.readouterr()
    written = target.read_text().replace(str(target), words[-1])
    # Wrapped lines may break differently around the longer temporary path.
    assert _command(written)[:-1] == words[:-1]
    body = written[written.index(NOTES_MARKER):]
    assert body == shipped.read_text()[shipped.read_text().index(NOTES_MARKER):], (
        f"run `{' '.join(words)}` to refresh the recipe")
    predicted = [line for line in written.splitlines() if line.startswith("# Predicted")]
    assert predicted == [line for line in shipped.read_text().splitlines()
                         if line.startswith("# Predicted")]


def test_no_recipe_is_written_when_nothing_fits(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "r.yaml"
    assert plan_main(["model=kimi-k2", "cluster.nodes=2", "rollout.nodes=1"], as_json=False,
                     recipe=target) == 1
    assert not target.exists()
