"""The receiving end of `rl.weight_sync=memory` inside vLLM's workers.

vLLM mixes a worker extension into every worker of an engine
(`vllm serve ... --worker-extension-cls moerl.rollout.vllm_extension.WeightReceiver`,
which `rollout.backends.engine_argv` adds) and calls its methods on all workers at
once through `POST /collective_rpc {"method", "args", "kwargs"}` (a development
endpoint, on with `VLLM_SERVER_DEV_MODE=1`, as the disk reload uses too). The
trainer (`rl.weight_stream`) calls:

- `moerl_join_weight_group(master_address, master_port, rank_offset, world_size,
  group_name, backend, timeout_s)`: each worker joins the trainer's weight group as
  rank `rank_offset + self.rank` (its rank in the engine);
- `moerl_update_weights(names, dtypes, shapes, version)`: one broadcast per tensor
  from the trainer, in Hugging Face names and the served dtype, in that order (as
  SGLang's protocol); each tensor goes to `model.load_weights`, which keeps the slice
  this worker's tensor/expert parallelism holds;

then `POST /reset_prefix_cache`, so no cached prefix outlives the weights it was
computed with. moerl must be importable in vLLM's Python. Only torch is imported
here: the module loads inside vLLM's worker processes.
"""

from __future__ import annotations

from typing import Any

import torch

from moerl.rollout.weight_group import GroupSpec, WeightGroup, open_group, receive_each


class WeightReceiver:
    """Methods vLLM adds to its worker; `self` is the worker (`rank`, `device`,
    `model_runner.model`)."""

    rank: int
    model_runner: Any
    _moerl_group: WeightGroup | None = None
    _moerl_version: int | None = None

    def moerl_join_weight_group(self, master_address: str, master_port: int, rank_offset: int,
                                world_size: int, group_name: str, backend: str,
                                timeout_s: float = 600.0) -> int:
        """Join the trainer's group; returns this worker's rank in it."""
        spec = GroupSpec(master_address, master_port, rank_offset, world_size, group_name,
                         backend, timeout_s)
        rank = rank_offset + int(self.rank)
        self._moerl_group = open_group(spec, rank)
        return rank

    def moerl_update_weights(self, names: list[str], dtypes: list[str],
                             shapes: list[list[int]], version: int) -> int:
        """Receive the announced tensors into the live model; returns how many."""
        if self._moerl_group is None:
            raise RuntimeError("moerl_update_weights: no weight group; the trainer calls "
                               "moerl_join_weight_group first")
        device = getattr(self, "device", None) or torch.device("cpu")
        model = self.model_runner.model
        count = 0
        for name, tensor in receive_each(self._moerl_group, names, dtypes, shapes, device):
            model.load_weights(weights=[(name, tensor)])
            count += 1
        self._moerl_version = version
        return count
