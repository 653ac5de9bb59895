"""Every shipped experiment and every override example of the README loads; an unknown or
mistyped field of any group (an objective's arguments and a domain's included) fails
when the config is read, naming the field, and `moerl train` then starts nothing; the
YAML files under configs/ hold only what differs from the dataclass defaults."""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest
import yaml

from moerl.config import RunConfig, compose, load_model_config, load_run_config, typed_run_config
from moerl.data.domain_config import DomainConfig, DomainSampling
from moerl.launchers import recipes
from moerl.launchers.lm import load_lm_config
from moerl.launchers.sft import load_sft_config
from moerl.models.arch import TINY
from moerl.models.weights_marker import MARKER
from moerl.rl.objective_config import GRPOConfig, ISCorrectionConfig
from moerl.typed_config import ConfigError, defaults_of

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
TESTS = REPO / "tests"
# Configs of `moerl train`-family commands whose Hydra overrides the README shows.
COMMANDS = ("train", "demo", "nemo", "sft", "train-lm", "model-info")


def readme_examples() -> list[str]:
    """Each `moerl <command> ...` of the README: code-block lines (with their `\\`
    continuations) and inline code, comments cut off."""
    text = (REPO / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found.append(line.split("  #")[0].strip())
    found += [span.replace("\n", " ") for span in re.findall(r"`(moerl [^`]+)`", text)]
    pattern = re.compile(rf"^moerl ({'|'.join(map(re.escape, COMMANDS))})( |$)")
    return sorted({f for f in found if pattern.match(f)})


@pytest.fixture(scope="module")
def user_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the README's examples name as the user's: weights dirs (`moerl sft` output,
    a `moerl hf import` dir with model.json and tokenizer files), task files."""
    sys.path.insert(0, str(TESTS))
    from tokenizer_dirs import make_tokenizer_dir

    root = tmp_path_factory.mktemp("user")
    for weights in ("runs/sft/weights", "runs/imported"):
        (root / weights).mkdir(parents=True)
        (root / weights / MARKER).write_text("")
    (root / "runs/imported/model.json").write_text(json.dumps(dataclasses.asdict(TINY)))
    make_tokenizer_dir(root / "runs/imported")
    (root / "my_tasks").symlink_to(TESTS / "integration" / "user_tasks")
    # The configs with the README's own domain file (configs/domain/<name>.yaml).
    shutil.copytree(CONFIGS, root / "configs")
    text = (REPO / "README.md").read_text()
    mine = re.search(r"```yaml\n(# @package data.domains\n.*?)```", text, re.S)
    assert mine is not None, "the README's example of a domain file"
    name = re.search(r"^(\w+):$", mine.group(1), re.M)
    assert name is not None and name.group(1) != "defaults"
    (root / "configs" / "domain" / f"{name.group(1)}.yaml").write_text(mine.group(1))
    return root


@pytest.fixture
def in_user_dir(user_files: Path) -> Iterator[Path]:
    cwd = Path.cwd()
    os.environ["MOERL_CONFIG_DIR"] = str(user_files / "configs")
    os.chdir(user_files)
    try:
        yield user_files
    finally:
        os.chdir(cwd)
        del os.environ["MOERL_CONFIG_DIR"]


def _world(overrides: list[str]) -> int:
    """Ranks a command's layout needs (`moerl train-lm parallel.tp=2` runs under torchrun)."""
    world = 1
    for word in overrides:
        if m := re.match(r"parallel\.(tp|pp|cp|dp)=(\d+)$", word):
            world *= int(m.group(2))
    return world


@pytest.mark.parametrize("example", readme_examples())
def test_every_readme_override_example_loads(example: str, in_user_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    words = [w for w in shlex.split(example) if not w.startswith(("-", "["))
             and w not in ("...", "HF_DIR", "WEIGHTS_DIR") and not w.startswith("<")]
    # A value the README names in capitals (rl.seed=S): any one will do.
    words = [re.sub(r"=[A-Z]+$", "=0", w) for w in words]
    command, overrides = words[1], words[2:]
    monkeypatch.setenv("WORLD_SIZE", str(_world(overrides)))
    if command in ("train", "nemo", "demo"):
        cfg = load_run_config(["+experiment=demo", *overrides] if command == "demo" else overrides)
        assert isinstance(cfg, RunConfig)
    elif command == "sft":
        load_sft_config(overrides)
    elif command == "train-lm":
        load_lm_config(overrides)
    else:
        load_model_config(overrides)


def test_the_readme_examples_are_found() -> None:
    examples = readme_examples()
    assert "moerl train +experiment=quick" in examples
    assert any(e.startswith("moerl sft model_from=") and "out_dir=runs/sft" in e
               for e in examples)  # a continued line, whole
    assert len(examples) >= 15, examples


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("experiment/*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_experiment_loads(path: Path) -> None:
    if path.stem in {**recipes.RECIPES, **recipes.MINIATURES}:
        # A planner recipe: the trainer composes the config its overrides imply.
        # (compose_here: the weights it starts from are on the cluster, not here.)
        recipe = recipes.load_recipe(path)
        cfg = recipes.compose_here(recipes.trainer_overrides(recipe, recipes.h100_site()))
        assert cfg.model.name == recipe.model
    else:
        cfg = load_run_config([f"+experiment={path.stem}"], world_size=1)
        assert isinstance(cfg, RunConfig)


def _group_classes() -> dict[str, type]:
    """Every config group of a run and every group nested in one, by its path in the
    composed config; the groups a field's value chooses with the choices composed below."""
    def nested(cls: type, path: str) -> dict[str, type]:
        out = {path: cls} if path else {}
        for name, tp in get_type_hints(cls).items():
            if dataclasses.is_dataclass(tp) and name != "objective_args":
                out |= nested(typing.cast(type, tp), f"{path}.{name}".lstrip("."))
        return out

    return nested(RunConfig, "") | {
        "rl.objective_args": GRPOConfig, "rl.objective_args.is_correction": ISCorrectionConfig,
        "data.domains.code": DomainConfig, "data.domains.code.sampling": DomainSampling}


GROUPS = _group_classes()


@pytest.fixture(scope="module")
def composed() -> dict[str, Any]:
    """One composition for the field checks: a domain, and an IS correction to reach."""
    return compose(["domain=[code]", "+rl.objective_args.is_correction.upper=2.0"])


def _at(data: dict[str, Any], path: str) -> dict[str, Any]:
    for key in path.split("."):
        data = data[key]
    return data


def _mistyped(cls: type) -> tuple[str, str]:
    """A field of `cls` that only numbers, booleans or a few names fit, and a word
    that fits none of them."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        options = set(get_args(hints[f.name])) - {type(None)} or {hints[f.name]}
        if options <= {int, float, bool} or get_origin(hints[f.name]) is Literal or all(
                isinstance(o, type) and issubclass(o, enum.Enum) for o in options):
            return f.name, "no-such-value"
    raise AssertionError(f"{cls.__name__} has no field a word cannot fill")


def test_every_group_is_checked(composed: dict[str, Any]) -> None:
    top = {k for k, v in defaults_of(RunConfig).items() if isinstance(v, dict)}
    assert top <= set(GROUPS), top - set(GROUPS)
    assert typed_run_config(composed, world_size=1).rl.objective_args.is_correction is not None


@pytest.mark.parametrize("group", GROUPS)
def test_an_unknown_field_of_any_group_fails_at_load(group: str,
                                                    composed: dict[str, Any]) -> None:
    data = copy.deepcopy(composed)
    _at(data, group)["no_such_field"] = 1
    with pytest.raises(ConfigError, match=rf"^{re.escape(group)}\.no_such_field: unknown key"):
        typed_run_config(data, world_size=1)


@pytest.mark.parametrize("group", GROUPS)
def test_a_mistyped_field_of_any_group_fails_at_load(group: str,
                                                    composed: dict[str, Any]) -> None:
    data = copy.deepcopy(composed)
    name, value = _mistyped(GROUPS[group])
    _at(data, group)[name] = value
    with pytest.raises(ConfigError, match=rf"^{re.escape(group)}\.{name}: "):
        typed_run_config(data, world_size=1)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rl.no_such_field=1"], r"Could not override 'rl\.no_such_field'"),
    (["+rl.objective_args.eps_hgh=0.3"],
     r"rl\.objective_args\.eps_hgh: unknown key for GRPOConfig"),
    (["rl.objective=cispo", "+rl.objective_args.dual_clip=3"],
     r"rl\.objective_args\.dual_clip: unknown key for CISPOConfig"),
    (["data.domains.code.eval_size=few", "domain=[code]"],
     r"data\.domains\.code\.eval_size: expected an integer"),
])
def test_overrides_are_checked_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(overrides, world_size=1)


def test_a_bad_objective_argument_starts_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=quick",
         f"run_dir={run}", "rl.objective=dr_grpo", "+rl.objective_args.norm_len=zero"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "rl.objective_args.norm_len: expected a number" in proc.stderr + proc.stdout
    assert not run.exists()  # nothing was written, no stage started


def _redundant(data: Any, defaults: Any, prefix: str) -> Iterator[str]:
    for key, value in (data or {}).items():
        if key == "defaults" or key not in defaults:
            continue
        default = defaults[key]
        if isinstance(value, dict) and isinstance(default, dict) and value and default:
            yield from _redundant(value, default, f"{prefix}{key}.")
        elif value == default and type(value) is type(default):
            yield f"{prefix}{key}"


# Experiments pin the choices they were measured with, the H100 recipes are the
# planner's output: only the groups' files and the roots must be free of defaults.
GROUP_FILES = sorted(p for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "experiment")


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_group_files_hold_only_what_differs_from_the_defaults(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    group = path.parent.name
    if group == "domain":
        entries = [(name, entry, defaults_of(DomainConfig)) for name, entry in data.items()
                   if name != "defaults"]
        repeated = [r for name, entry, dflt in entries for r in _redundant(entry, dflt, f"{name}.")]
    else:
        repeated = list(_redundant(data, defaults_of(RunConfig)[group], ""))
    assert not repeated, f"{path}: {repeated} repeat the dataclass defaults; remove them"


@pytest.mark.parametrize("root", ["config", "lm", "sft_run"])
def test_roots_start_from_the_schema_defaults(root: str) -> None:
    data = yaml.safe_load((CONFIGS / f"{root}.yaml").read_text())
    assert data["defaults"][0] == "schema"
    if root == "config":
        assert not list(_redundant(data, defaults_of(RunConfig), ""))
