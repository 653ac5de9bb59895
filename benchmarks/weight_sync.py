"""Weight sync: disk against memory, the stream's model against this machine, and one
Kimi-K2 version projected on its recipe's layouts and the h100 cluster's links.

    .venv/bin/python benchmarks/weight_sync.py [--sizes tiny,1b] [--pushes 4] [--ranks 4,8]
    .venv/bin/python benchmarks/weight_sync.py --smoke   # tiny; the model at 2 ranks

disk against memory: seconds per version pushed from a trainer (this process, one rank)
to a rollout server (`moerl serve rollout`, one rank), both ways side by side, for the
tiny model and one of about 1B parameters: the trainer publishes the version
(Megatron's distributed checkpoint) and the server loads it, or the trainer streams it
over the weight group (gloo here, NCCL on GPUs). Each time is a push as the RL loop
makes it, from the call until the server answers, median over the pushes; the memory
path's first push forms the group and is shown apart.

the model: trainer jobs of 4 ranks (TP2-EP2) and 8 (TP2-PP2-EP2), each a torchrun of
`_weight_sync_job.py`, stream a 0.2B model into two servers of 2 ranks (EP2, TP2).
Each job first measures this machine under the stream's own transport (pack, gloo,
unpack): one link's rate, the time a message adds, and what all rank pairs move at once
(two shared cores), each the median of three rounds; the model (`planning.weight_sync.version_time`)
then predicts a version's seconds from the plan (each rank's bytes and messages, known
before a byte moves), set against the measured median.

Kimi-K2: the same plan for its recipe's layouts (configs/experiment/kimi_k2_h100.yaml),
computed without building them, over configs/cluster/h100.yaml's links; every term.
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
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _smoke import parse_with_smoke

from moerl.models.arch import KIMI_K2, TINY, MoEArch
from moerl.parent_death import wrapped

TABLE_TITLE = "weight sync: disk against memory"
SMOKE = {"sizes": "tiny", "pushes": 2, "ranks": "2", "model": "tiny", "servers": "one"}
SIZES = {
    "tiny": TINY.replace(mtp_num_layers=0),
    # 0.21B parameters: the tiny model's shape, wider.
    "mid": TINY.replace(name="tiny-mid", hidden_size=768, num_attention_heads=8,
                        num_experts=16, moe_ffn_hidden_size=768, ffn_hidden_size=3072,
                        vocab_size=16384, q_lora_rank=256, kv_lora_rank=192,
                        qk_head_dim=64, v_head_dim=64, qk_pos_emb_head_dim=32,
                        mtp_num_layers=0),
    # 1.02B parameters (0.19B active): the tiny model's shape, wider and deeper.
    "1b": TINY.replace(name="tiny-1b", hidden_size=1024, num_layers=10, num_attention_heads=8,
                       num_experts=32, moe_ffn_hidden_size=1024, ffn_hidden_size=4096,
                       vocab_size=32768, q_lora_rank=384, kv_lora_rank=256, qk_head_dim=64,
                       v_head_dim=64, qk_pos_emb_head_dim=32, mtp_num_layers=0),
}
LAYOUTS = {2: ["--tp", "2"], 4: ["--tp", "2", "--ep", "2"], 8: ["--tp", "2", "--ep", "2",
                                                                 "--pp", "2"]}
SERVERS = {"one": [(1, [])], "two": [(2, ["--ep", "2"]), (2, ["--tp", "2"])]}
JOB = Path(__file__).with_name("_weight_sync_job.py")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,1b", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--pushes", type=int, default=4, help="versions pushed each way")
    parser.add_argument("--ranks", default="4,8", help=f"trainer jobs, of {list(LAYOUTS)}")
    parser.add_argument("--model", default="mid", help="the model check's model")
    parser.add_argument("--servers", default="two", help=f"the model check's, {list(SERVERS)}")
    args = parse_with_smoke(parser, SMOKE, argv)
    args.sizes = args.sizes.split(",")
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    if unknown := sorted({*args.sizes, args.model} - set(SIZES)):
        parser.error(f"--sizes / --model: unknown {unknown}; choose from {', '.join(SIZES)}")
    if unknown_ranks := sorted(set(args.ranks) - set(LAYOUTS)):
        parser.error(f"--ranks: {unknown_ranks}; choose from {list(LAYOUTS)}")
    if args.pushes < 2:
        parser.error("--pushes: at least 2 (the memory path's first forms the group)")
    return args


@contextmanager
def server(arch: MoEArch, tmp: Path, ranks: int = 1, flags: Sequence[str] = ()) -> Iterator[str]:
    """A rollout server of `arch` (random init) on `ranks` ranks (torchrun); its URL."""
    from moerl.rendezvous import discover, wait_healthy

    arch_file = tmp / f"{arch.name}.json"
    arch_file.write_text(json.dumps(asdict(arch)))
    rendezvous = Path(tempfile.mkdtemp(prefix="rendezvous-", dir=tmp))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable])
    argv = [*launcher, "-m", "moerl.launchers.cli", "serve", "rollout", "--port", "0",
            "--arch-file", str(arch_file), "--backend", "static",
            "--rendezvous-dir", str(rendezvous), *flags]
    log = open(rendezvous / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(wrapped(argv), stdout=log, stderr=subprocess.STDOUT)

    def alive() -> None:
        if proc.poll() is not None:
            raise SystemExit(f"rollout server exited {proc.returncode}: see {log.name}")

    try:
        (url,) = discover(rendezvous, "rollout", 1, timeout=900, check=alive)
        wait_healthy(url, timeout=300, check=alive)
        yield f"http://{url}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def disk_and_memory(arch: MoEArch, pushes: int, tmp: Path) -> dict[str, float]:
    """One trainer rank (this process) to one server rank, each way."""
    from _weight_sync_job import Trained

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
            for _ in range(pushes + 1 if way == "memory" else pushes):  # + its disk start
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


def stream_job(arch: MoEArch, ranks: int, urls: list[str], pushes: int, tmp: Path
               ) -> dict[str, Any]:
    """One trainer job of `ranks` ranks (torchrun) into the servers at `urls`."""
    arch_file, out = tmp / f"job-{arch.name}.json", tmp / f"job-{ranks}.out.json"
    arch_file.write_text(json.dumps(asdict(arch)))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", str(JOB), "--arch-file", str(arch_file),
            "--urls", ",".join(urls), "--root", str(tmp / f"job-{ranks}"), "--out", str(out),
            "--pushes", str(pushes), *LAYOUTS[ranks]]
    with open(tmp / f"job-{ranks}.log", "wb") as log:
        code = subprocess.run(wrapped(argv), stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"trainer job of {ranks} ranks exited {code}: see {log.name}")
    return dict(json.loads(out.read_text()))


def predict(job: dict[str, Any], links: dict[str, float]) -> Any:
    """The model's terms for a job's version, from its plan and measured `links`."""
    from moerl.parallel.shard_messages import Load
    from moerl.planning.weight_sync import Links, StreamLoads, version_time

    senders, receivers = {}, {}
    for rank, per_dst in enumerate(job["senders"]):
        senders[rank] = Load(bytes_sent=sum(b for b, _ in per_dst.values()),
                             messages_sent=sum(m for _, m in per_dst.values()))
        for dst, (nbytes, messages) in per_dst.items():
            into = receivers.setdefault(int(dst), Load())
            into.bytes_received += nbytes
            into.messages_received += messages
    # install is a pointer swap on CPU: only the largest shard's size is kept
    held = dict(enumerate(r["held_bytes"] for ranks in job["received"].values()
                          for r in ranks))
    return version_time(StreamLoads(senders, receivers, held), Links(**links))


def model_rows(jobs: dict[int, dict[str, Any]]) -> list[str]:
    """Per job: the measured links, the model's terms and its total, the measured time
    (medians over the versions, each predicted from the links measured just before)."""
    rows = [f"{'ranks':>5} {'link':>6} {'latency':>8} {'shared':>7} {'send s':>7} "
            f"{'recv s':>7} {'shared s':>9} {'model s':>8} {'measured s':>11} {'off':>6}"]
    for ranks, job in jobs.items():
        versions = job["versions"]
        terms = [predict(job, v["links"]) for v in versions]
        med = {k: statistics.median(v["links"][k] for v in versions) for k in versions[0]["links"]}
        off = statistics.median(v["seconds"] / t.total - 1 for v, t in zip(versions, terms,
                                                                             strict=True))
        rows.append(
            f"{ranks:>5} {med['bandwidth'] / 1e9:>6.2f} {med['latency'] * 1e3:>8.3f} "
            f"{med['shared'] / 1e9:>7.2f} {statistics.median(t.send for t in terms):>7.3f} "
            f"{statistics.median(t.receive for t in terms):>7.3f} "
            f"{statistics.median(t.shared for t in terms):>9.3f} "
            f"{statistics.median(t.total for t in terms):>8.3f} "
            f"{statistics.median(v['seconds'] for v in versions):>11.3f} {off:>+6.0%}")
    return rows


def kimi_projection(staging_bytes: int) -> list[str]:
    """Kimi-K2 on its recipe's layouts over the h100 cluster's links: each term."""
    from moerl.launchers.recipes import h100_cluster, load_recipe, recipe_path
    from moerl.models.count import count_params
    from moerl.parallel.layout import ParallelLayout
    from moerl.planning.weight_sync import Links, stream_loads, version_time

    recipe = load_recipe(recipe_path("kimi_k2_h100"))
    p, cluster = recipe.parallel, h100_cluster()
    trainer = ParallelLayout(tp=p["tp"], pp=p["pp"], vpp=p["vpp"], ep=p["ep"], etp=p["etp"],
                             cp=p["cp"], dp=p["dp"], stage_layers=p.get("stage_layers"))
    engine = ParallelLayout.for_world(recipe.engine_ranks, tp=recipe.rollout_tp,
                                      ep=recipe.rollout_ep)
    plan = stream_loads(KIMI_K2, trainer, engine, recipe.rollout_replicas, staging_bytes // 2)
    known = {n: getattr(cluster, n) for n in ("nvlink_gbps", "ib_gbps", "pcie_gbps",
                                              "message_latency_us")}
    if missing := [n for n, v in known.items() if v is None]:
        raise SystemExit(f"configs/cluster/h100.yaml: set cluster.{', cluster.'.join(missing)} "
                         "(the links of one GPU) for the projection")
    gb, latency = 1e9, known["message_latency_us"] * 1e-6
    links = Links(known["ib_gbps"] * gb, latency, staging=known["pcie_gbps"] * gb,
                  install=known["pcie_gbps"] * gb)
    t = version_time(plan, links)
    send = max(plan.senders.values(), key=lambda s: s.bytes_sent)
    receive = max(plan.receivers.values(), key=lambda r: r.bytes_received)
    mean = statistics.mean(s.bytes_sent for s in plan.senders.values())
    return [
        f"Kimi-K2, one bf16 version: trainer {trainer.describe()} ({trainer.world_size} GPUs) "
        f"-> {recipe.rollout_replicas} engines of {engine.describe()}; h100 links: IB "
        f"{known['ib_gbps']:g} GB/s, PCIe {known['pcie_gbps']:g} GB/s, NVLink "
        f"{known['nvlink_gbps']:g} GB/s, {known['message_latency_us']:g} us a message; "
        f"messages of {staging_bytes // 2 >> 20} MiB",
        f"  send     busiest trainer GPU {send.bytes_sent / gb:.1f} GB (mean {mean / gb:.1f}) "
        f"in {send.messages_sent} messages over IB: {t.send:.2f} s",
        f"  receive  busiest engine GPU {receive.bytes_received / gb:.1f} GB in "
        f"{receive.messages_received} messages, IB then PCIe into host staging: "
        f"{t.receive:.2f} s",
        "  NVLink   0 B: trainer and engine GPUs are on different nodes, and each engine "
        "GPU receives its own slices",
        f"  wire     the slower of the two, every link at once: {t.wire:.2f} s",
        f"  install  {max(plan.held.values()) / gb:.1f} GB host -> GPU between two batches: "
        f"{t.install:.2f} s",
        f"  total    {t.total:.2f} s a version",
        f"  SGLang / vLLM (whole tensors from rank 0): the model, "
        f"{2 * count_params(KIMI_K2)[0] / gb / 1e3:.2f} TB, through one IB link: at least "
        f"{2 * count_params(KIMI_K2)[0] / links.bandwidth:.0f} s",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moerl-weight-sync-") as name:
        tmp = Path(name)
        results = {size: disk_and_memory(SIZES[size], args.pushes, tmp) for size in args.sizes}
        with ExitStack() as stack:
            model = SIZES[args.model]
            urls = [stack.enter_context(server(model, tmp, ranks, flags))
                    for ranks, flags in SERVERS[args.servers] if args.ranks]
            jobs = {ranks: stream_job(model, ranks, urls, args.pushes, tmp)
                    for ranks in args.ranks}
    print(TABLE_TITLE)
    print(f"one trainer rank -> one rollout server rank, fp32, median of {args.pushes} pushes "
          "each way (memory: after the first, which forms the group)")
    print(f"{'model':<6} {'params':>14} {'disk s':>8} {'memory s':>9} {'1st memory s':>13} "
          f"{'disk/memory':>12} {'memory GB/s':>12}")
    for size, r in results.items():
        print(f"{size:<6} {r['params']:>14,} {r['disk']:>8.3f} {r['memory']:>9.3f} "
              f"{r['join']:>13.3f} {r['disk'] / r['memory']:>11.2f}x "
              f"{r['bytes'] / r['memory'] / 1e9:>12.2f}")
    if jobs:
        print(f"\nthe stream's model against this machine: {args.model} model into "
              f"{len(urls)} server(s), medians of {args.pushes} versions, each predicted from "
              "the machine measured just before it (GB/s; latency ms; off: measured / model - 1)")
        print("\n".join(model_rows(jobs)))
    print()
    print("\n".join(kimi_projection(256 << 20)))


if __name__ == "__main__":
    main()
