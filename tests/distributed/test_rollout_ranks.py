"""The rollout server across ranks: `moerl serve rollout --tp/--ep/--pp` under torchrun
(gloo, 2 ranks) against the one-process server, both over HTTP, from the same
published weights. TP2, EP2 and TP2-EP2 run the continuous engine (at EP2 with
data-parallel attention: each rank serves its own requests, which /health counts),
PP2 the static decoder.

Greedy completions must be the same tokens and their logprobs within 1e-5; seeded
sampled completions the same tokens; a weight update must reach every rank (the
answers after it equal the one-process server's after the same update) and a
broken update must leave every rank on the old version.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch

from moerl.rollout.client import RolloutClient
from moerl.rollout.types import Sample, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from rollout_servers import publish, rollout_server

TOLERANCE = 1e-5
PROMPTS = [list(b"def add(a, b):\n    return"), list(b"Return n times 3."), list(b"x = 1\ny =")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
LAYOUTS = {"tp2": ["--tp", "2"], "ep2": ["--ep", "2"], "tp2_ep2": ["--tp", "2", "--ep", "2"],
           "pp2": ["--pp", "2"]}


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rollout_ranks")
    return publish(1, root / "v0"), publish(2, root / "v1")


def _answers(client: RolloutClient, weights_v1: Path) -> dict[str, list[list[Sample]]]:
    out = {"greedy": client.generate(PROMPTS, 1, GREEDY),
           "sampled": client.generate(PROMPTS, 2, SAMPLED)}
    client.update_weights(weights_v1, 1)
    out["greedy_v1"] = client.generate(PROMPTS, 1, GREEDY)
    with pytest.raises(Exception, match="not a complete weights checkpoint"):
        client.update_weights(weights_v1.parent / "missing", 2)
    out["after_refused"] = client.generate(PROMPTS, 1, GREEDY)
    return out


@pytest.fixture(scope="module")
def single(weights: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, list[list[Sample]]]:
    v0, v1 = weights
    with rollout_server(tmp_path_factory.mktemp("single"), 1, [], v0) as client:
        return _answers(client, v1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_server_across_ranks_answers_as_one_process(
        layout: str, weights: tuple[Path, Path], single: dict[str, list[list[Sample]]],
        tmp_path: Path) -> None:
    v0, v1 = weights
    with rollout_server(tmp_path, 2, LAYOUTS[layout], v0) as client:
        answers = _answers(client, v1)
        health = httpx.get(f"{client.urls[0]}/health").json()
    assert health["backend"] == ("static" if layout == "pp2" else "continuous")
    if layout == "ep2":  # two attention replicas, each given its share of the rows
        assert len(health["replica_rows"]) == 2 and min(health["replica_rows"]) > 0
    for key, groups in single.items():
        for mine, theirs in zip(answers[key], groups, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert a.token_ids == b.token_ids, (layout, key)
                assert a.weight_version == b.weight_version, (layout, key)
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                           atol=TOLERANCE, rtol=0, msg=f"{layout} {key}")
    assert [s.weight_version for (s,) in answers["greedy_v1"]] == [1, 1, 1]
    # v1 is another model: its answers differ from v0's
    assert [s.token_ids for (s,) in answers["greedy_v1"]] != [
        s.token_ids for (s,) in answers["greedy"]]
