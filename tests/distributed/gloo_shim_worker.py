"""The CPU shim that needs two gloo ranks to show that it is needed: `uneven_gather`.

Run under torchrun with 2 ranks; rank 0 writes JSON to --out: what Megatron's uneven
all-gather did with the shim lifted (the error, or "ok") and with it in place.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = [3, 1]  # rows held by rank 0 and rank 1: uneven, as routed tokens are


def _outcome(call: Callable[[], torch.Tensor], expected: torch.Tensor) -> str:
    try:
        got = call()
    except RuntimeError as err:  # gloo's refusal
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return "ok" if torch.equal(got, expected) else "wrong values"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    from megatron.core.tensor_parallel import mappings

    from moerl.parallel.cpu_shims import apply_cpu_shims, shim_disabled

    apply_cpu_shims()
    rank = dist.get_rank()
    # Rank r holds SIZES[r] rows of r + 1; gathered: both ranks' rows in rank order.
    mine = torch.full((SIZES[rank], 2), float(rank + 1))
    expected = torch.cat([torch.full((n, 2), float(r + 1)) for r, n in enumerate(SIZES)])

    def gather() -> torch.Tensor:
        return mappings._gather_along_first_dim(mine, dist.group.WORLD, SIZES)

    with shim_disabled("uneven_gather"):
        without = _outcome(gather, expected)
    dist.barrier()
    result = {"without": without, "with": _outcome(gather, expected)}
    if rank == 0:
        args.out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
