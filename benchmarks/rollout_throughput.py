"""Rollout server throughput: generated tokens/s at batch 1, 8 and 32, against a plain
loop that re-runs the whole sequence for every new token, in the same run.

    .venv/bin/python benchmarks/rollout_throughput.py [--new-tokens 32] [--threads 1]

The server is a real `moerl serve rollout` process on 127.0.0.1 (random tiny MoE,
fixed seed); "1 req" sends the B prompts in one call, "conc." sends B one-prompt
calls at once (the server's batcher groups what has queued), "client" is
`RolloutClient.generate` (one call for up to 32 prompts, as the RL loop sends them).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

SEED = 3
BATCHES = (1, 8, 32)


def start_server(threads: int, rendezvous: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.rollout.server", "--port", "0", "--seed", str(SEED),
         "--max-batch", "32", "--rendezvous-dir", str(rendezvous)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not (rendezvous / "rollout-0").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("rollout server did not start")
        time.sleep(0.2)
    return proc


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
    tokens = sum(len(c["token_ids"]) for r in replies for c in r.json()["choices"])
    assert tokens == batch * new
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout

    init_parallel(ParallelLayout(), seed=SEED)
    (model,) = build_model(TINY, ParallelLayout())
    model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(args.threads, Path(tmp))
        url = f"http://{(Path(tmp) / 'rollout-0').read_text().strip()}"
        try:
            server_tokens_per_s(url, 2, 4, concurrent=False)  # warm-up
            no_cache_tokens_per_s(model, 2, 2)
            print(f"tiny MoE, 12-token prompts, {args.new_tokens} new tokens, "
                  f"{args.threads} thread(s); generated tokens/s")
            print(f"{'batch':>5} {'no-cache loop':>14} {'1 req':>7} {'conc.':>7} {'client':>7}"
                  f" {'ratio 1 req':>12} {'ratio conc.':>12} {'ratio client':>13}")
            for batch in BATCHES:
                base = no_cache_tokens_per_s(model, batch, args.new_tokens)
                one = server_tokens_per_s(url, batch, args.new_tokens, concurrent=False)
                conc = server_tokens_per_s(url, batch, args.new_tokens, concurrent=True)
                via = client_tokens_per_s(url, batch, args.new_tokens)
                print(f"{batch:>5} {base:>14.0f} {one:>7.0f} {conc:>7.0f} {via:>7.0f}"
                      f" {one / base:>11.2f}x {conc / base:>11.2f}x {via / base:>12.2f}x")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    destroy_parallel()


if __name__ == "__main__":
    main()
