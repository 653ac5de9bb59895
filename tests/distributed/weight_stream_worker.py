"""The trainer side of the in-memory weight sync test: a TP2-EP2 trainer (4 ranks)
pushes version 1 (the start: by disk) and version 2 (streamed over the weight group)
to the rollout servers at `--urls`, then also publishes version 2 to `--disk` for the
disk path to compare with. Rank 0 writes what the sync did as JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.models.arch import TINY, MoEArch
from moerl.models.build import build_model
from moerl.models.weights import save_weights
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl.weight_stream import MemoryWeightSync
from moerl.rl.weight_sync import FilesystemWeightSync
from moerl.rollout.client import RolloutClient


@dataclass
class Trained:
    """What a weight sync reads of a policy."""

    arch: MoEArch
    chunks: list[torch.nn.Module]

    def publish(self, directory: str | Path) -> Path:
        return save_weights(self.chunks, directory)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--urls", required=True)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--disk", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    layout = ParallelLayout.for_world(4, tp=2, ep=2)
    groups = init_parallel(layout, seed=3)
    policy = Trained(TINY, list(build_model(TINY, layout)))
    engines = RolloutClient(args.urls.split(",")) if groups.rank == 0 else None
    sync = MemoryWeightSync(FilesystemWeightSync(args.root, engines, keep=2), engines, TINY,
                            staging_bytes=2 << 20)
    sync.push(policy, 1)
    with torch.no_grad():  # a new version: the same change on every replica
        for param in policy.chunks[0].parameters():
            param.mul_(1.01)
    sync.push(policy, 2)
    policy.publish(args.disk)
    dist.barrier()
    if groups.rank == 0:
        assert engines is not None
        args.out.write_text(json.dumps({"pushed": sync.pushed, "streamed": sync.streamed,
                                        "version": engines.weight_version}))
    destroy_parallel()


if __name__ == "__main__":
    main()
