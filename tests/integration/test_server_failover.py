"""Servers that die mid-step (RELIABILITY: failed stages), with real processes on 127.0.0.1.

- rollout: two servers with the same weights; one is killed while a seeded generation
  is in flight: the call completes on the other with exactly the samples it would have
  had anyway (seeds are per prompt, not per server) and the killed server is marked
  dead; with both gone the call fails with `RolloutUnavailable` (the step aborts, no
  empty samples); a server restarted on its port is found by the health check and
  serves again.
- reward: two servers; one is killed while it scores a batch: the client moves the
  batch to the other and every item gets its real reward, none an infra error or 0.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from local_servers import reward_command, rollout_command, started

from moerl.ports import free_port
from moerl.rewards.client import RewardClient, RewardClientConfig, ScoreItem
from moerl.rollout.client import RolloutClient, RolloutClientConfig, RolloutUnavailable
from moerl.rollout.types import SamplingParams

SEED = 5
PROMPTS = [[256, *b"def f(x):"], [256, *b"print("], [256, *b"# sum"], [256, *b"x = ["]] * 3


def _tokens(groups: list[list[Any]]) -> list[list[list[int]]]:
    return [[list(s.token_ids) for s in g] for g in groups]


def _when(condition: Callable[[], bool], then: Callable[[], None], limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    then()


def test_rollout_call_survives_a_killed_server_and_a_restart_is_found(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    sampling = SamplingParams(max_tokens=24, temperature=1.0, seed=SEED, ignore_eos=True)
    config = RolloutClientConfig(max_attempts=6, backoff_base_s=0.1, backoff_cap_s=0.5,
                                 timeout_s=120)
    with (started(rollout_command(tmp_path / "a", 3, ports[0]), tmp_path / "a", "rollout") as a,
          started(rollout_command(tmp_path / "b", 3, ports[1]), tmp_path / "b", "rollout") as b):
        client = RolloutClient(urls, config=config)
        reference = _tokens(client.generate(PROMPTS, n=2, sampling=sampling))

        # Kill the first server once calls are running on both.
        busy = lambda: all(client._in_flight[u] > 0 for u in urls)  # noqa: E731
        killer = threading.Thread(target=_when, args=(busy, a.kill))
        killer.start()
        again = _tokens(client.generate(PROMPTS, n=2, sampling=sampling))
        killer.join()
        a.wait()
        assert again == reference
        assert client.dead == {urls[0]}

        b.kill()
        b.wait()
        with pytest.raises(RolloutUnavailable):
            client.generate(PROMPTS[:2], n=1, sampling=sampling)

        restarted = rollout_command(tmp_path / "a2", 3, ports[0])
        with started(restarted, tmp_path / "a2", "rollout"):
            assert _tokens(client.generate(PROMPTS, n=2, sampling=sampling)) == reference
            assert urls[0] not in client.dead
        client.close()


PRINT_AFTER_A_WHILE = "import time\ntime.sleep(1.0)\nprint('ok')\n"


@pytest.mark.sandbox
def test_reward_batch_moves_to_another_server_when_its_server_dies(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    dirs = [tmp_path / "a", tmp_path / "b"]
    with started(reward_command(dirs[0]), dirs[0], "reward") as a, \
            started(reward_command(dirs[1]), dirs[1], "reward"):
        urls = tuple(f"http://{(d / 'reward' / '0.addr').read_text().strip()}" for d in dirs)
        client = RewardClient(RewardClientConfig(batch_size=2, max_in_flight=4,
                                                 backoff_base_s=0.05, backoff_cap_s=0.2,
                                                 timeout_s=60), urls=urls, seed=0)
        spec = {"language": "python", "cases": [{"input": "", "output": "ok"}]}
        items = [ScoreItem("stdio", PRINT_AFTER_A_WHILE + f"# {i}\n", spec) for i in range(8)]
        # The sandboxes of the first server are running (each item sleeps 1 s): kill it.
        killer = threading.Timer(0.6, a.kill)
        killer.start()
        report = client.score(items, step=0)
        killer.join()
        a.wait()
        rewards = [r.reward for r in report.results]
        print(f"rewards {rewards}  metrics {report.metrics}")
        assert rewards == [1.0] * len(items)
        assert report.metrics["reward/retries"] >= 1
        client.close()
