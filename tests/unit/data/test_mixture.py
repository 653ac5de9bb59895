"""Mixtures of domains: draws by weight, exact resume, the domains' records and the
config checks that name the field."""

from __future__ import annotations

import collections
import random

import pytest

from moerl.config import load_run_config
from moerl.data.domain_config import DomainConfig
from moerl.data.domains.registry import domain_records
from moerl.data.mixture import MixtureStream
from moerl.data.prompt_sources import load_prompts
from moerl.data.prompts import DataConfig, DatasetError, PromptRecord
from moerl.typed_config import ConfigError


def _records(domains: dict[str, int]) -> list[PromptRecord]:
    return [PromptRecord(f"{d}/{i}", f"prompt {d} {i}", "format", domain=d)
            for d, count in domains.items() for i in range(count)]


def _stream(weights: dict[str, float], seed: int = 0) -> MixtureStream:
    return MixtureStream.of(_records({d: 7 for d in weights}), weights, seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_draw_gives_each_domain_its_share(seed: int) -> None:
    rng = random.Random(seed)
    weights = {d: rng.choice([0.5, 1.0, 2.0, 3.0]) for d in "abcde"}
    total = sum(weights.values())
    stream = _stream(weights, seed)
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(50):
        count = rng.randrange(1, 20)
        drawn = collections.Counter(r.domain for r in stream.take(count))
        for name, weight in weights.items():  # floor or ceil of count * share
            assert abs(drawn[name] - count * weight / total) < 1, (drawn, count)
        counts += drawn
    assert stream.state()["mixture"]["taken"] == dict(counts)


def test_a_zero_weight_domain_is_never_drawn_and_a_missing_one_is_refused() -> None:
    stream = _stream({"a": 1.0, "b": 0.0, "c": 1.0})
    assert {r.domain for r in stream.take(200)} == {"a", "c"}
    with pytest.raises(DatasetError, match=r"data\.domains\.b: no prompts"):
        MixtureStream.of(_records({"a": 3}), {"a": 1.0, "b": 1.0}, 0)


def test_a_restored_mixture_continues_the_same_draws() -> None:
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    straight = MixtureStream.of(_records({"a": 5, "b": 3, "c": 9}), weights, 4, set_aside_epochs=1)
    resumed = MixtureStream.of(_records({"a": 5, "b": 3, "c": 9}), weights, 4, set_aside_epochs=1)
    for _ in range(3):
        for record in straight.take(6):
            straight.settle(record, [1.0, 1.0] if record.uid.endswith("1") else [0.0, 1.0])
    resumed.restore(straight.state())
    assert [r.uid for r in resumed.take(30)] == [r.uid for r in straight.take(30)]


def test_a_changed_mixture_is_refused_unless_allowed() -> None:
    state = _stream({"a": 1.0, "b": 1.0}).state()
    other = _stream({"a": 2.0, "b": 1.0})
    with pytest.raises(DatasetError, match=r"data\.mixture or data\.seed changed"):
        other.restore(state)
    other.restore(state, strict=False)
    with pytest.raises(DatasetError, match=r"not a mixture's state"):
        other.restore({"position": 3, "seed": 0, "size": 14})


def test_domains_are_tagged_and_held_out_apart() -> None:
    cfg = DataConfig(source="mixture", mixture={"c": 1.0, "m": 1.0}, domains={
        "c": DomainConfig(source="code", train_size=5, eval_size=2),
        "m": DomainConfig(source="math", train_size=4, eval_size=3, reward="format")})
    train, held_out, report = load_prompts(cfg)
    assert collections.Counter(r.domain for r in train) == {"c": 5, "m": 4}
    assert collections.Counter(r.domain for r in held_out) == {"c": 2, "m": 3}
    assert {r.reward for r in train if r.domain == "m"} == {"format"}  # the override
    assert not {r.uid for r in train} & {r.uid for r in held_out}
    assert all(r.uid.startswith(f"{r.domain}/") for r in train + held_out)
    assert report.loaded == 9


def test_prompts_over_the_domains_token_limit_are_dropped_or_refused() -> None:
    domain = DomainConfig(source="code", train_size=6, eval_size=0, max_prompt_tokens=40)
    got = domain_records("c", domain, 0, 256, strict=False, sources={},
                         tokens=lambda r: 30 if r.uid.endswith(("0", "1")) else 50)
    assert len(got.train) == 2 and got.report.dropped == {"prompt longer than "
                                                          "max_prompt_tokens": 4}
    with pytest.raises(DatasetError, match=r"data\.domains\.c: prompt .* longer than 40"):
        domain_records("c", domain, 0, 256, strict=True, sources={}, tokens=lambda r: 50)


def test_a_generator_option_error_names_the_domain_field() -> None:
    domain = DomainConfig(source="code", options={"constans": [3]})
    with pytest.raises(DatasetError, match=r"data\.domains\.c\.options\.constans"):
        domain_records("c", domain, 0, 256, strict=False, sources={})


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.source=mixture"], "data.mixture: source=mixture needs domain weights"),
    (["domain=[code]", "data.source=mixture", "+data.mixture={code:1,maths:1}"],
     "data.mixture.maths: no domain 'maths'"),
    (["domain=[code]", "data.source=mixture", "+data.mixture={code:-1}"],
     "data.mixture.code: a weight must be >= 0"),
    (["domain=[code]", "+data.mixture={code:1}"], "set data.source=mixture"),
    (["domain=[code]", "data.source=mixture", "+data.mixture={code:1}",
      "data.domains.code.source=nope"], "data.domains.code.source: 'nope'"),
    (["domain=[code]", "data.source=mixture", "+data.mixture={code:1}",
      "data.domains.code.group_size=1"], "data.domains.code.group_size"),
    (["domain=[documents]", "data.source=mixture", "+data.mixture={documents:1}"],
     r"data.domains.documents: sampling.max_tokens \(32\) \+ max_prompt_tokens \(1800\) "
     r"exceeds model.max_position_embeddings \(1024\)"),
    (["domain=[code,terminal]", "data.source=mixture", "+data.mixture={code:1,terminal:1}",
      "rl.task_source=agent"], "put the agent tasks in it as a domain"),
    (["domain=[terminal]", "data.source=mixture", "+data.mixture={terminal:1}",
      "+data.domains.terminal.reward=math"], "graded by their tasks' checks"),
])  # fmt: skip
def test_impossible_mixtures_are_refused_naming_the_field(overrides: list[str],
                                                           message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(overrides, world_size=1)


def test_the_multidomain_experiment_composes_six_domains() -> None:
    cfg = load_run_config(["+experiment=multidomain"], world_size=1)
    assert set(cfg.data.mixture) == set(cfg.data.domains) == {
        "code", "programs", "math", "documents", "tools", "terminal"}
    assert cfg.runs_episodes  # the terminal domain brings environment servers
    assert cfg.data.domains["tools"].sampling.max_tokens == 128  # the experiment's override
