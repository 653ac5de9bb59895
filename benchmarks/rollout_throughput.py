"""Rollout server throughput: generated tokens/s at batch 1, 8 and 32, against a plain
loop that re-runs the whole sequence for every new token, in the same run.

    .venv/bin/python benchmarks/rollout_throughput.py [--new-tokens 32] [--threads 1]
    .venv/bin/python benchmarks/rollout_throughput.py --smoke   # batches 1 and 2, 2 tokens

The server is a real `moerl serve rollout` process on 127.0.0.1 (random tiny MoE,
fixed seed), found through the rendezvous directory it announces itself in; "1 req"
sends the B prompts in one call, "conc." sends B one-prompt calls at once (the
server's batcher groups what has queued), "client" is `RolloutClient.generate` (one
call for up to 32 prompts, as the RL loop sends them).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from _smoke import parse_with_smoke

SEED = 3
TABLE_TITLE = "rollout server throughput"
SMOKE = {"batches": [1, 2], "new_tokens": 2}
START_TIMEOUT_S = 180.0  # a shared machine may take minutes to import and build the model


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=1)
    return parse_with_smoke(parser, SMOKE, argv)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def rollout_server(threads: int, max_batch: int, rendezvous: Path) -> Iterator[Callable[[], str]]:
    """Start a rollout server process; yields a call that waits until it has announced
    itself and returns its URL, so the caller can work while the server starts."""
    from moerl.parent_death import wrapped
    from moerl.rendezvous import discover

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    log = rendezvous / "server.log"
    with open(log, "wb") as err:
        # Through the parent-death wrapper: the server ends with this process on any exit,
        # a SIGKILL of the benchmark included.
        proc = subprocess.Popen(
            wrapped([sys.executable, "-m", "moerl.rollout.server", "--host", "127.0.0.1",
                     "--port", "0", "--seed", str(SEED), "--max-batch", str(max_batch),
                     "--rendezvous-dir", str(rendezvous)]),
            env=env, stdout=subprocess.DEVNULL, stderr=err,
        )

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"rollout server exited ({proc.returncode}):\n{_tail(log)}")

    def url() -> str:
        (address,) = discover(rendezvous, "rollout", 1, START_TIMEOUT_S, check=alive)
        return f"http://{address}"

    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prompts(batch: int, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(0, 256, (batch, length), generator=gen).tolist()


def server_tokens_per_s(url: str, batch: int, new: int, concurrent: bool) -> float:
    body = {"max_tokens": new, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    items = prompts(batch)
    start = time.perf_counter()
    with httpx.Client(timeout=600) as http:
        if concurrent:
            with ThreadPoolExecutor(batch) as pool:
                replies = list(pool.map(
                    lambda p: http.post(f"{url}/v1/completions", json={"prompt": p, **body}),
                    items))
        else:
            replies = [http.post(f"{url}/v1/completions", json={"prompt": items, **body})]
    elapsed = time.perf_counter() - start
    for reply in replies:
        reply.raise_for_status()
    tokens = sum(len(c["token_ids"]) for r in replies for c in r.json()["choices"])
    assert tokens == batch * new, f"{tokens} tokens generated, {batch * new} asked for"
    return tokens / elapsed


def client_tokens_per_s(url: str, batch: int, new: int) -> float:
    from moerl.rollout.client import RolloutClient
    from moerl.rollout.types import SamplingParams

    client = RolloutClient([url])
    start = time.perf_counter()
    groups = client.generate(prompts(batch), n=1,
                             sampling=SamplingParams(max_tokens=new, seed=1, ignore_eos=True))
    elapsed = time.perf_counter() - start
    client.close()
    return sum(len(g[0].token_ids) for g in groups) / elapsed


def no_cache_tokens_per_s(model: torch.nn.Module, batch: int, new: int) -> float:
    tokens = torch.tensor(prompts(batch))  # [B, P]
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(new):
            positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
            logits = model(tokens, positions, None)  # [B, S, V]
            nxt = torch.multinomial(torch.softmax(logits[:, -1].float(), -1), 1)  # [B, 1]
            tokens = torch.cat([tokens, nxt], dim=1)
    return batch * new / (time.perf_counter() - start)


def print_table(url: str, model: torch.nn.Module, args: argparse.Namespace) -> None:
    print(f"{TABLE_TITLE}: tiny MoE, 12-token prompts, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s); generated tokens/s")
    print(f"{'batch':>5} {'no-cache loop':>14} {'1 req':>7} {'conc.':>7} {'client':>7}"
          f" {'ratio 1 req':>12} {'ratio conc.':>12} {'ratio client':>13}")
    for batch in args.batches:
        base = no_cache_tokens_per_s(model, batch, args.new_tokens)
        one = server_tokens_per_s(url, batch, args.new_tokens, concurrent=False)
        conc = server_tokens_per_s(url, batch, args.new_tokens, concurrent=True)
        via = client_tokens_per_s(url, batch, args.new_tokens)
        print(f"{batch:>5} {base:>14.0f} {one:>7.0f} {conc:>7.0f} {via:>7.0f}"
              f" {one / base:>11.2f}x {conc / base:>11.2f}x {via / base:>12.2f}x")


def local_model() -> torch.nn.Module:
    """The server's model (same preset and seed) in this process, for the baseline loop."""
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.parallel.groups import init_parallel
    from moerl.parallel.layout import ParallelLayout

    init_parallel(ParallelLayout(), seed=SEED)
    (model,) = build_model(TINY, ParallelLayout())
    return model.eval()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from moerl.parallel.groups import destroy_parallel

    with tempfile.TemporaryDirectory() as tmp, \
            rollout_server(args.threads, max(args.batches), Path(tmp)) as server_url:
        model = local_model()  # built while the server starts
        url = server_url()
        server_tokens_per_s(url, 2, 4, concurrent=False)  # warm-up
        no_cache_tokens_per_s(model, 2, 2)
        print_table(url, model, args)
    destroy_parallel()

if __name__ == "__main__":
    main()
