"""The held-out code tasks are held out: no held-out prompt occurs among the SFT rows or
the RL prompts (the demo's, any seed or size, the mixture's `code` domain), and they
still test the training tasks' skill."""

from __future__ import annotations

import pytest

from moerl.agent.suite import select_tasks
from moerl.config import load_run_config
from moerl.data.code_tasks import HELD_OUT_NAMES, OPERATOR_WORDS, TRAIN_NAMES, make_tasks
from moerl.data.domains.registry import domain_records
from moerl.data.prompt_sources import load_prompts
from moerl.data.prompts import DataConfig, PromptRecord
from moerl.data.sft import instruction_examples
from moerl.data.tokenizer_build import build_tokenizer
from moerl.rl.agent_collect import terminal_source


def _signature(prompt: str) -> str:
    return prompt.splitlines()[0]  # "def name(arg):"


def _assert_apart(held_out: list[PromptRecord], training_texts: list[str]) -> None:
    """No held-out prompt, nor even its signature line, occurs in a training text."""
    assert held_out
    training = "\n".join(training_texts)
    for record in held_out:
        assert _signature(record.prompt) not in training, record.prompt


def _docstring(prompt: str) -> str:
    return prompt.split('"""')[1]  # "Return n times 3."


def _assert_same_skill(held_out: list[PromptRecord], train: list[PromptRecord]) -> None:
    """The held-out tasks use the training tasks' operator words, arguments and
    constants, only their names are new: the docstrings are the training ones."""
    assert {_docstring(r.prompt) for r in held_out} <= {_docstring(r.prompt) for r in train}
    assert {w for r in held_out for w in OPERATOR_WORDS if f" {w} " in r.prompt} == set(
        OPERATOR_WORDS)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_demos_held_out_prompts_occur_in_no_sft_row_or_rl_prompt(seed: int) -> None:
    cfg = load_run_config(["+experiment=demo", f"data.seed={seed}", f"rl.seed={seed}"],
                          world_size=1)
    train, held_out, _ = load_prompts(cfg.data)
    # The SFT rows as the trainer builds them (sft_phase), read back from their tokens.
    tok = build_tokenizer(cfg.tokenizer, cfg.model.vocab_size)
    sft_rows = [tok.decode(list(ex.prompt_ids))
                for ex in instruction_examples(tok, cfg.sft.data_path, train)]
    assert len(sft_rows) == cfg.data.train_size
    # RL draws its prompts from the training records (PromptStream over `train`).
    _assert_apart(held_out, sft_rows + [r.prompt for r in train])
    assert len(held_out) == cfg.data.eval_size
    _assert_same_skill(held_out, train)
    assert sum(" times " in r.prompt for r in held_out) >= cfg.data.eval_size // 5


@pytest.mark.parametrize(("train_size", "eval_size", "seed", "constants"), [
    (1, 1, 0, None), (2000, 64, 5, None), (300, 1000, 7, [3]), (5000, 200, 11, [0, 9]),
])
def test_held_out_code_tasks_stay_apart_at_any_size(train_size: int, eval_size: int,
                                                    seed: int, constants: list[int] | None,
                                                    ) -> None:
    cfg = DataConfig(train_size=train_size, eval_size=eval_size, seed=seed,
                     constants=constants, sft_correct_fraction=0.5)
    train, held_out, _ = load_prompts(cfg)
    _assert_apart(held_out, [r.prompt for r in train])
    assert len(held_out) == eval_size
    assert all(r.spec["entry_point"] in HELD_OUT_NAMES for r in held_out)


@pytest.mark.parametrize("seed", [0, 3])
def test_the_code_domains_held_out_prompts_stay_apart(seed: int) -> None:
    cfg = load_run_config(["+experiment=multidomain", f"data.seed={seed}",
                           "data.domains.code.train_size=3000",
                           "data.domains.code.eval_size=300"], world_size=1)
    got = domain_records("code", cfg.data.domains["code"], cfg.data.seed,
                         cfg.data.max_prompt_tokens, strict=True, sources={})
    _assert_apart(got.held_out, [r.prompt for r in got.train])
    _assert_same_skill(got.held_out, got.train)


def test_the_name_pools_are_apart_and_only_held_out_tasks_use_theirs() -> None:
    assert not set(TRAIN_NAMES) & set(HELD_OUT_NAMES)
    assert {t.entry_point for t in make_tasks(400, seed=1)} == set(TRAIN_NAMES)
    assert {t.entry_point for t in make_tasks(400, seed=1, held_out=True)} == set(
        HELD_OUT_NAMES)


@pytest.mark.parametrize("domain", ["math", "programs", "documents", "tools"])
def test_every_generated_domains_held_out_prompts_are_unseen(domain: str) -> None:
    """Whatever a domain's generator makes, the held-out set keeps no training prompt
    (math's small space gave one at the multidomain sizes), and says how many it left out."""
    cfg = load_run_config(["+experiment=multidomain", "data.seed=0",
                           f"data.domains.{domain}.eval_size=64"], world_size=1)
    got = domain_records(domain, cfg.data.domains[domain], cfg.data.seed,
                         cfg.data.max_prompt_tokens, strict=False, sources={})
    train = {r.prompt for r in got.train}
    assert got.held_out and not any(r.prompt in train for r in got.held_out)
    left_out = got.report.dropped.get("held-out prompt also a training prompt", 0)
    assert len(got.held_out) + left_out <= 64


@pytest.mark.parametrize("categories", [[], ["git", "logs"], ["c"]])
def test_the_terminal_domain_holds_out_tasks_it_never_trains_on(categories: list[str]) -> None:
    """The agent suite has no separate held-out tasks: a quarter of the selected ones are
    held out, the same whatever the seeds, and none of them is a training task."""
    cfg = load_run_config(["+experiment=multidomain", "data.domains.terminal.eval_size=100",
                           f"rl.agent.categories={categories}"], world_size=1)
    source = terminal_source(cfg.rl.agent)
    selected = select_tasks(categories=categories)
    splits = [domain_records("terminal", cfg.data.domains["terminal"], seed, 0,
                             strict=True, sources={"terminal": source}) for seed in (0, 7)]
    for got in splits:
        train = {r.spec["task"] for r in got.train}
        held_out = {r.spec["task"] for r in got.held_out}
        assert len(held_out) == len(selected) // 4 and not train & held_out
        assert train | held_out == {t.id for t in selected}
        assert "held-out prompt also a training prompt" not in got.report.dropped
    assert {r.spec["task"] for r in splits[0].held_out} == {
        r.spec["task"] for r in splits[1].held_out}
