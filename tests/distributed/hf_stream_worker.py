"""The trainer side of the SGLang and vLLM weight stream tests: a `--tp` x `--ep`
trainer of the tiny model with the latent norms the Hugging Face layout has, versions
1 (the start: an HF export on disk) and 2 (streamed in the `--engine`'s protocol to a
server of `--server-ranks` ranks, rank 0 assembling each tensor from the ranks that own
its pieces) pushed to the server at `--url`; then the weights of version 2 exported to
`--expect` for the test to compare with."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from weight_stream_worker import Trained

from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.hf import export_hf
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl.weight_sync_build import build_weight_sync
from moerl.rollout.client import RolloutClient

ARCH = TINY.replace(latent_norms=True, mtp_num_layers=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--expect", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--engine", default="sglang", choices=["sglang", "vllm"])
    parser.add_argument("--server-ranks", default=1, type=int)
    parser.add_argument("--tp", default=1, type=int)
    parser.add_argument("--ep", default=1, type=int)
    args = parser.parse_args()
    layout = ParallelLayout.for_world(args.tp * args.ep, tp=args.tp, ep=args.ep)
    groups = init_parallel(layout, seed=5)
    policy = Trained(ARCH, list(build_model(ARCH, layout)))
    engines = RolloutClient([args.url], engine=args.engine) if groups.rank == 0 else None
    sync = build_weight_sync(args.engine, args.root, engines, mode="memory", arch=ARCH,
                             dtype="bfloat16", server_ranks=args.server_ranks)
    sync.push(policy, 1)
    with torch.no_grad():
        for param in policy.chunks[0].parameters():
            param.mul_(1.01)
    sync.push(policy, 2)
    export_hf(policy.chunks, ARCH, args.expect, dtype=torch.bfloat16)
    if groups.rank == 0:
        args.out.write_text(json.dumps({"streamed": getattr(sync, "streamed", 0)}))
    destroy_parallel()


if __name__ == "__main__":
    main()
