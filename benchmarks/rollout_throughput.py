"""Rollout throughput, side by side in one run on the same threads: the continuous engine
against transformers' `generate` and against the static decoder, and an EP2 server with
data-parallel attention against one rank.

    .venv/bin/python benchmarks/rollout_throughput.py [--threads 1] [--new-tokens 128]
    .venv/bin/python benchmarks/rollout_throughput.py --smoke   # smallest sizes, no EP2

The servers are real `moerl serve rollout` processes on 127.0.0.1 serving the tiny MoE
(random weights, fixed seed; its context raised to 4096 for 2,000-token prompts),
found through the rendezvous directories they announce themselves in; every process
runs with OMP_NUM_THREADS=--threads. Each figure is the best of --repeats runs, the
contenders taking turns, so that load from elsewhere hurts them alike; tokens/s count
generated tokens over the wall time of the whole load.

1. batch: B 12-token prompts in one request, --new-tokens each (ignore_eos),
   sampled: the continuous server, the static one (`--backend static`) and
   transformers' DeepseekV3ForCausalLM of the same shape (KV cache, `generate`) in
   this process.
2. mixed: --mixed prompts of 20 to 2,000 tokens (log-uniform), each with a
   long-tailed response length (log-normal, median 32, at most 512), sent at once as
   one-prompt requests: continuous against static.
3. dp attention: the mixed load (--ep-mixed prompts) on a one-rank continuous server
   and on two ranks of `--ep 2` (each rank its own requests and KV cache, experts split),
   plus the same prompts greedy on both, whose tokens must be equal (every server
   then loads one published copy of the weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch
from _smoke import parse_with_smoke

SEED = 3
TABLE_TITLE = "rollout throughput"
NEEDS_MODULES = ("transformers",)
SMOKE = {"batches": [1, 2], "new_tokens": 4, "mixed": 2, "max_prompt": 64, "ep_mixed": 0,
         "repeats": 1}
START_TIMEOUT_S = 300.0  # a shared machine may take minutes to import and build the model
CONTEXT = 4096


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--mixed", type=int, default=32, help="prompts of the mixed load")
    parser.add_argument("--max-prompt", type=int, default=2000)
    parser.add_argument("--ep-mixed", type=int, default=64,
                        help="prompts of the data-parallel attention load (0: skip it)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    return parse_with_smoke(parser, SMOKE, argv)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def rollout_server(directory: Path, threads: int, arch_file: Path, flags: Sequence[str] = (),
                   ranks: int = 1) -> Iterator[Callable[[], str]]:
    """A rollout server process (under torchrun for `ranks` > 1); yields a call that waits
    until it has announced itself and returns its URL."""
    from moerl.parent_death import wrapped
    from moerl.rendezvous import discover

    directory.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    serve = ["-m", "moerl.launchers.cli", "serve", "rollout", "--host", "127.0.0.1", "--port",
             "0", "--seed", str(SEED), "--arch-file", str(arch_file), "--rendezvous-dir",
             str(directory), *flags]
    launcher = [sys.executable, *(["-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={ranks}"] if ranks > 1 else [])]
    log = directory / "server.log"
    with open(log, "wb") as out:
        # Through the parent-death wrapper: the server ends with this process on any exit.
        proc = subprocess.Popen(wrapped([*launcher, *serve]), env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"rollout server exited ({proc.returncode}):\n{_tail(log)}")

    def url() -> str:
        (address,) = discover(directory, "rollout", 1, START_TIMEOUT_S, check=alive)
        return f"http://{address}"

    try:
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the loads ------------------------------------------------------------------------


def short_prompts(batch: int, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(0, 256, (batch, length), generator=gen).tolist()


def mixed_load(count: int, max_prompt: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, response length) pairs: prompts log-uniform in [20, max_prompt] tokens,
    responses log-normal (median 32) capped at 512."""
    gen = torch.Generator().manual_seed(seed)
    low, high = math.log(min(20, max_prompt)), math.log(max_prompt)
    load = []
    for _ in range(count):
        length = int(math.exp(low + (high - low) * torch.rand((), generator=gen).item()))
        response = math.exp(math.log(32) + torch.randn((), generator=gen).item())
        prompt = torch.randint(0, 256, (length,), generator=gen).tolist()
        load.append((prompt, max(1, min(512, round(response)))))
    return load


def serve_load(url: str, load: list[tuple[list[int], int]], greedy: bool = False
               ) -> tuple[float, list[tuple[int, ...]]]:
    """Send every (prompt, length) at once, one request each: (generated tokens/s, the
    token ids of every answer)."""
    def one(item: tuple[int, tuple[list[int], int]]) -> httpx.Response:
        index, (prompt, length) = item
        body = {"prompt": prompt, "max_tokens": length, "temperature": 0.0 if greedy else 1.0,
                "seed": index, "ignore_eos": True}
        return http.post(f"{url}/v1/completions", json=body)

    with httpx.Client(timeout=1800) as http, ThreadPoolExecutor(max(1, len(load))) as pool:
        start = time.perf_counter()
        replies = list(pool.map(one, enumerate(load)))
        elapsed = time.perf_counter() - start
    answers: list[tuple[int, ...]] = []
    for reply in replies:
        reply.raise_for_status()
        answers.extend(tuple(c["token_ids"]) for c in reply.json()["choices"])
    tokens = sum(len(a) for a in answers)
    assert tokens == sum(n for _, n in load), "every response runs to its length"
    return tokens / elapsed, answers


def _load_tokens_per_s(url: str, load: list[tuple[list[int], int]]) -> float:
    return serve_load(url, load)[0]


def batch_tokens_per_s(url: str, batch: int, new: int) -> float:
    body = {"prompt": short_prompts(batch), "max_tokens": new, "temperature": 1.0, "seed": 1,
            "ignore_eos": True}
    with httpx.Client(timeout=1800) as http:
        start = time.perf_counter()
        reply = http.post(f"{url}/v1/completions", json=body)
        elapsed = time.perf_counter() - start
    reply.raise_for_status()
    tokens = sum(len(c["token_ids"]) for c in reply.json()["choices"])
    assert tokens == batch * new, f"{tokens} tokens generated, {batch * new} asked for"
    return tokens / elapsed


def best(runs: int, contenders: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each contender's best tokens/s over `runs` rounds, taking turns."""
    out = dict.fromkeys(contenders, 0.0)
    for _ in range(runs):
        for name, run in contenders.items():
            out[name] = max(out[name], run())
    return out


# -- transformers' generate ------------------------------------------------------------


def hf_model(arch: Any) -> Any:
    """transformers' DeepseekV3ForCausalLM of `arch`'s shape, random weights, eval mode."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from moerl.models.hf_mapping import hf_config_from_arch

    config = hf_config_from_arch(arch)
    for key in ("architectures", "model_type"):
        config.pop(key)
    torch.manual_seed(SEED)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**config)).eval()


def hf_tokens_per_s(model: Any, batch: int, new: int) -> float:
    ids = torch.tensor(short_prompts(batch))  # [B, 12]
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=True, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == new
    return batch * new / elapsed


# -- the tables -----------------------------------------------------------------------


def batch_table(urls: dict[str, str], model: Any, args: argparse.Namespace) -> None:
    print(f"{TABLE_TITLE}: tiny MoE, {args.threads} thread(s) per process; generated "
          f"tokens/s, best of {args.repeats}")
    print(f"batch: B 12-token prompts in one request, {args.new_tokens} new tokens each")
    print(f"{'B':>4} {'transformers':>13} {'static':>8} {'continuous':>11} "
          f"{'x transformers':>15} {'x static':>9}")
    new = args.new_tokens
    for batch in args.batches:
        got = best(args.repeats, {
            "hf": partial(hf_tokens_per_s, model, batch, new),
            "static": partial(batch_tokens_per_s, urls["static"], batch, new),
            "continuous": partial(batch_tokens_per_s, urls["continuous"], batch, new),
        })
        hf, static, cont = got["hf"], got["static"], got["continuous"]
        print(f"{batch:>4} {hf:>13.0f} {static:>8.0f} {cont:>11.0f} "
              f"{cont / hf:>14.2f}x {cont / static:>8.2f}x")


def mixed_table(urls: dict[str, str], args: argparse.Namespace) -> None:
    load = mixed_load(args.mixed, args.max_prompt)
    prompt_tokens = sum(len(p) for p, _ in load)
    lengths = sorted(n for _, n in load)
    print(f"mixed: {len(load)} one-prompt requests at once, prompts 20-{args.max_prompt} "
          f"tokens ({prompt_tokens} in all), responses {lengths[0]}-{lengths[-1]} tokens "
          f"(median {lengths[len(lengths) // 2]})")
    got = best(args.repeats, {name: partial(_load_tokens_per_s, urls[name], load)
                              for name in ("static", "continuous")})
    print(f"{'static':>8} {got['static']:>8.0f} tokens/s")
    print(f"{'continuous':>8} {got['continuous']:>6.0f} tokens/s  "
          f"x{got['continuous'] / got['static']:.2f} static")


def ep_table(urls: dict[str, str], args: argparse.Namespace) -> None:
    load = mixed_load(args.ep_mixed, args.max_prompt, seed=1)
    print(f"dp attention: the mixed load of {len(load)} prompts; one rank against --ep 2 "
          f"(2 ranks, each its own requests), {args.threads} thread(s) per rank")
    got = best(args.repeats, {name: partial(_load_tokens_per_s, urls[name], load)
                              for name in ("continuous", "ep2", "one_rank_2_threads")})
    _, one = serve_load(urls["continuous"], load, greedy=True)
    _, two = serve_load(urls["ep2"], load, greedy=True)
    same = sum(a == b for a, b in zip(one, two, strict=True))
    print(f"{'one rank':>22} {got['continuous']:>8.0f} tokens/s")
    print(f"{'one rank, 2 threads':>22} {got['one_rank_2_threads']:>8.0f} tokens/s")
    print(f"{'ep2, dp attention':>22} {got['ep2']:>8.0f} tokens/s  "
          f"x{got['ep2'] / got['continuous']:.2f} one rank, "
          f"x{got['ep2'] / got['one_rank_2_threads']:.2f} one rank on 2 threads")
    print(f"greedy tokens equal to one rank's for {same}/{len(load)} prompts")


def _arch_file(directory: Path) -> tuple[Path, Any]:
    from moerl.models.arch import TINY

    arch = TINY.replace(max_position_embeddings=CONTEXT)
    path = directory / "arch.json"
    path.write_text(json.dumps(dataclasses.asdict(arch)))
    return path, arch


def _publish(arch_path: Path, directory: Path, threads: int) -> Path:
    """The model of `arch_path` (seed SEED) saved as the trainer publishes weights: a
    server's random init depends on its layout (an EP rank draws its own experts), so
    one-rank and EP2 servers must load the same published weights to be compared."""
    code = (
        "import json, sys; from moerl.models.arch import MoEArch; from moerl.models.build "
        "import build_model; from moerl.models.weights import save_weights; from moerl."
        "parallel.groups import init_parallel; from moerl.parallel.layout import "
        "ParallelLayout; from moerl.typed_config import from_dict; "
        "arch = from_dict(MoEArch, json.loads(open(sys.argv[1]).read()), 'model'); "
        f"init_parallel(ParallelLayout(), seed={SEED}); "
        "save_weights(build_model(arch, ParallelLayout()), sys.argv[2])"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, "-c", code, str(arch_path), str(directory)], env=env,
                   check=True, capture_output=True, timeout=START_TIMEOUT_S)
    return directory


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        root = Path(tmp)
        arch_path, arch = _arch_file(root)
        servers: dict[str, Callable[[], str]] = {}
        weights = (["--weights", str(_publish(arch_path, root / "weights", args.threads))]
                   if args.ep_mixed else [])

        def start(name: str, flags: Sequence[str], ranks: int = 1,
                  threads: int = args.threads) -> None:
            servers[name] = stack.enter_context(rollout_server(
                root / name, threads, arch_path, [*weights, *flags], ranks))

        start("continuous", ["--backend", "continuous"])
        start("static", ["--backend", "static", "--max-batch", "32"])
        if args.ep_mixed:
            start("ep2", ["--ep", "2"], ranks=2)
            start("one_rank_2_threads", ["--backend", "continuous"], threads=2 * args.threads)
        model = hf_model(arch)  # built while the servers start
        urls = {name: url() for name, url in servers.items()}
        for url in urls.values():  # warm-up
            batch_tokens_per_s(url, 2, 2)
        print(f"load average at start: {os.getloadavg()[0]:.1f}")
        batch_table(urls, model, args)
        mixed_table(urls, args)
        if args.ep_mixed:
            ep_table(urls, args)
        print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
