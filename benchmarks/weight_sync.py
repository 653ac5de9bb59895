"""Weight sync, disk against memory: seconds per weight version pushed from a trainer
(this process, one rank) to a rollout server (`moerl serve rollout`, one rank), both
ways side by side in one run, for the tiny model and a model of about 1B parameters;
and what one Kimi-K2 version would take at the bytes/s the memory path measured.

    .venv/bin/python benchmarks/weight_sync.py [--sizes tiny,1b] [--pushes 4]
    .venv/bin/python benchmarks/weight_sync.py --smoke   # tiny, 2 pushes each way

disk (`rl.weight_sync=disk`): the trainer publishes the version (Megatron's
distributed checkpoint, atomic rename), then the server loads it. memory
(`rl.weight_sync=memory`): the trainer gathers the version and broadcasts it over the
weight group (gloo here, NCCL on GPUs) while the server receives and swaps it in. Each
time is a push as the RL loop makes it, from the call until the server answers, median
over the pushes; the memory path's first push forms the group and is shown apart. The
Kimi-K2 line divides its bf16 weights (2 bytes a parameter) by the measured bytes/s: a
CPU loopback figure, not a prediction for InfiniBand, shown for scale only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _smoke import parse_with_smoke

from moerl.models.arch import KIMI_K2, TINY, MoEArch
from moerl.parent_death import wrapped

TABLE_TITLE = "weight sync: disk against memory"
SMOKE = {"sizes": "tiny", "pushes": 2}
SIZES = {
    "tiny": TINY.replace(mtp_num_layers=0),
    # 1.02B parameters (0.19B active): the tiny model's shape, wider and deeper.
    "1b": TINY.replace(name="tiny-1b", hidden_size=1024, num_layers=10, num_attention_heads=8,
                       num_experts=32, moe_ffn_hidden_size=1024, ffn_hidden_size=4096,
                       vocab_size=32768, q_lora_rank=384, kv_lora_rank=256, qk_head_dim=64,
                       v_head_dim=64, qk_pos_emb_head_dim=32, mtp_num_layers=0),
}


@dataclass
class Trained:
    """What a weight sync reads of a policy."""

    arch: MoEArch
    chunks: list[Any]

    def publish(self, directory: str | Path) -> Path:
        from moerl.models.weights import save_weights

        return save_weights(self.chunks, directory)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,1b", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--pushes", type=int, default=4, help="versions pushed each way")
    args = parse_with_smoke(parser, SMOKE, argv)
    args.sizes = args.sizes.split(",")
    if unknown := sorted(set(args.sizes) - set(SIZES)):
        parser.error(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    if args.pushes < 2:
        parser.error("--pushes: at least 2 (the memory path's first forms the group)")
    return args


@contextmanager
def server(arch: MoEArch, tmp: Path) -> Iterator[str]:
    """A one-rank rollout server of `arch` (random init); its URL."""
    from moerl.rendezvous import discover, wait_healthy

    arch_file = tmp / f"{arch.name}.json"
    arch_file.write_text(json.dumps(asdict(arch)))
    rendezvous = tmp / f"rendezvous-{arch.name}"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "serve", "rollout", "--port", "0",
            "--arch-file", str(arch_file), "--backend", "static",
            "--rendezvous-dir", str(rendezvous)]
    log = open(tmp / f"server-{arch.name}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(wrapped(argv), stdout=log, stderr=subprocess.STDOUT)

    def alive() -> None:
        if proc.poll() is not None:
            raise SystemExit(f"rollout server exited {proc.returncode}: see {log.name}")

    try:
        (url,) = discover(rendezvous, "rollout", 1, timeout=600, check=alive)
        wait_healthy(url, timeout=120, check=alive)
        yield f"http://{url}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def measure(arch: MoEArch, pushes: int, tmp: Path) -> dict[str, float]:
    from moerl.models.build import build_model
    from moerl.models.count import count_params
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.rl.weight_stream import MemoryWeightSync
    from moerl.rl.weight_sync import FilesystemWeightSync
    from moerl.rollout.client import RolloutClient

    with server(arch, tmp) as url:
        init_parallel(ParallelLayout(), seed=0)
        policy = Trained(arch, list(build_model(arch, ParallelLayout())))
        client = RolloutClient([url])
        disk = FilesystemWeightSync(tmp / f"disk-{arch.name}", client, keep=1)
        memory = MemoryWeightSync(FilesystemWeightSync(tmp / f"memory-{arch.name}", client,
                                                       keep=1), client, arch)
        version = 0
        times: dict[str, list[float]] = {"disk": [], "memory": []}
        for way, sync in (("disk", disk), ("memory", memory)):
            pushes_here = pushes + 1 if way == "memory" else pushes  # + its disk start
            for _ in range(pushes_here):
                version += 1
                start = time.perf_counter()
                sync.push(policy, version)
                times[way].append(time.perf_counter() - start)
        client.close()
        destroy_parallel()
    assert memory.streamed == pushes, f"{pushes - memory.streamed} pushes fell back to disk"
    params = count_params(arch)[0]
    return {"params": params, "bytes": params * 4, "disk": statistics.median(times["disk"]),
            "join": times["memory"][1], "memory": statistics.median(times["memory"][2:]
                                                                    or times["memory"][1:])}


def main(argv: Sequence[str] | None = None) -> None:
    from moerl.models.count import count_params

    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="moerl-weight-sync-") as tmp:
        for name in args.sizes:
            results[name] = measure(SIZES[name], args.pushes, Path(tmp))
    print(TABLE_TITLE)
    print(f"one trainer rank -> one rollout server rank, fp32, median of {args.pushes} pushes "
          "each way (memory: after the first, which forms the group)")
    print(f"{'model':<6} {'params':>14} {'disk s':>8} {'memory s':>9} {'1st memory s':>13} "
          f"{'disk/memory':>12} {'memory GB/s':>12}")
    for name, r in results.items():
        print(f"{name:<6} {r['params']:>14,} {r['disk']:>8.3f} {r['memory']:>9.3f} "
              f"{r['join']:>13.3f} {r['disk'] / r['memory']:>11.2f}x "
              f"{r['bytes'] / r['memory'] / 1e9:>12.2f}")
    largest = max(results.values(), key=lambda r: r["params"])
    kimi = count_params(KIMI_K2)[0] * 2
    rate = largest["bytes"] / largest["memory"]
    print(f"Kimi-K2 ({kimi / 1e12:.2f} TB in bf16) at {rate / 1e9:.2f} GB/s: "
          f"{kimi / rate:.0f} s a version (loopback on this machine; for scale only)")


if __name__ == "__main__":
    main()
