"""The whole-model weight file (`models.whole_weights`): which layouts write it, a round
trip through `load_weights`, and a file that does not fit the model refused by name.
Other layouts reading it: tests/distributed/test_whole_weights_split_server.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.moe import moe_logging

from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.weights import load_weights, save_weights
from moerl.models.weights_marker import is_complete
from moerl.models.whole_weights import (
    FILE,
    WholeWeightsError,
    holds_whole,
    is_whole,
    save_whole,
)
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout


@pytest.fixture(scope="module")
def groups() -> Iterator[ParallelGroups]:
    g = init_parallel(ParallelLayout(), seed=3)
    yield g
    destroy_parallel()


def _model(seed: int) -> torch.nn.Module:
    moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(seed)
    (model,) = build_model(TINY, ParallelLayout())
    return model


def test_only_layouts_that_hold_the_whole_model_write_one_file() -> None:
    assert holds_whole(ParallelLayout()) and holds_whole(ParallelLayout(dp=4, cp=2))
    for split in ({"tp": 2}, {"pp": 2}, {"ep": 2}, {"pp": 2, "vpp": 2}):
        assert not holds_whole(ParallelLayout(**split))  # type: ignore[arg-type]


def test_round_trip_equals_the_sharded_format(groups: ParallelGroups, tmp_path: Path) -> None:
    source, whole, sharded = _model(1), _model(2), _model(2)
    path = save_whole([source], tmp_path / "v1")
    assert is_complete(path) and is_whole(path)
    assert not (tmp_path / ".v1.partial").exists()
    load_weights([whole], path)
    load_weights([sharded], save_weights([source], tmp_path / "v1-sharded"))
    want = source.state_dict()
    for name, tensor in whole.state_dict().items():
        if torch.is_tensor(tensor):
            assert torch.equal(tensor, want[name]), name
            assert torch.equal(tensor, sharded.state_dict()[name]), name
    with pytest.raises(FileExistsError):
        save_whole([source], path)


def test_a_file_missing_a_tensor_is_refused_by_name(groups: ParallelGroups,
                                                    tmp_path: Path) -> None:
    path = save_whole([_model(1)], tmp_path / "v1")
    tensors = torch.load(path / FILE, weights_only=True)
    del tensors["decoder.final_layernorm.weight"]
    torch.save(tensors, path / FILE)
    with pytest.raises(WholeWeightsError, match=r"decoder\.final_layernorm\.weight"):
        load_weights([_model(2)], path)
