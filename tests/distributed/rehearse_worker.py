"""The rehearsal's count of what memory_worker.py measures: the same tiny model and
optimizer, built by the same function, on each rank of a fake job of the same layout
(tensors without memory), counted by the same census.

    python rehearse_worker.py --out rehearsed.json --layouts '{"tp2": [2, {"tp": 2}]}'

writes {name: [census of rank 0, rank 1, ...]} (with each rank's pipeline rank).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from memory_worker import build_trainable

from moerl.parallel.groups import ParallelGroups
from moerl.parallel.layout import ParallelLayout
from moerl.rehearsal.build import trainable_census
from moerl.trainer.optimizer import Trainable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layouts", required=True, help="JSON: name -> [ranks, degrees]")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    for name, (ranks, degrees) in json.loads(args.layouts).items():
        layout = ParallelLayout.for_world(ranks, **degrees)

        def build(groups: ParallelGroups, layout: ParallelLayout = layout) -> Trainable:
            return build_trainable(layout, bf16=False)

        results[name] = [{"rank": rank, **trainable_census(layout, rank, build)}
                         for rank in range(ranks)]
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
