"""Write (one rank) or read (a rollout server's layout) the tiny model as one whole file.

    write: python whole_weights_worker.py --dir D   (one rank: D/whole and D/sharded)
    read:  torchrun ... whole_weights_worker.py --dir D --layout '{"tp": 2, "ep": 2}'

The reader builds the model under the layout as a rollout server does
(`rollout.ranks.serving_layout`), loads both copies and compares every tensor it holds;
rank 0 writes how many it compared and how many differed to D/read.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.models.weights import load_weights, save_weights
    from moerl.models.whole_weights import save_whole
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.rollout.ranks import serving_layout

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--layout", default=None)
    args = parser.parse_args()
    if args.layout is None:
        init_parallel(ParallelLayout(), seed=7)
        (model,) = build_model(TINY, ParallelLayout())
        save_whole([model], args.dir / "whole")
        save_weights([model], args.dir / "sharded")
        destroy_parallel()
        return
    world = int(__import__("os").environ["WORLD_SIZE"])
    layout = serving_layout(TINY, world, **json.loads(args.layout))
    groups = init_parallel(layout, seed=11)
    (whole,) = build_model(TINY, layout)
    (sharded,) = build_model(TINY, layout)
    load_weights([whole], args.dir / "whole")
    load_weights([sharded], args.dir / "sharded")
    want = sharded.state_dict()
    got = {k: v for k, v in whole.state_dict().items() if torch.is_tensor(v)}
    differ = torch.tensor([sum(not torch.equal(v, want[k]) for k, v in got.items())])
    dist.all_reduce(differ)
    if groups.rank == 0:
        (args.dir / "read.json").write_text(json.dumps({"compared": len(got),
                                                        "differ": int(differ)}))
    destroy_parallel()


if __name__ == "__main__":
    main()
