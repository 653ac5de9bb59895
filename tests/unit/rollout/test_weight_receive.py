"""What one rollout rank keeps of a streamed version (`rollout.weight_receive`): its
slices of the tensors it holds and nothing else. The layout is faked here (which
names this rank holds, and which it holds only a half of); the bytes go through the
real bucketing, views and buffer pool, from a stand-in group that replays what the
trainer's `send` broadcasts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moerl.models import hf
from moerl.models.arch import TINY
from moerl.rollout.weight_group import Manifest, buckets, spec_of
from moerl.rollout.weight_receive import BufferPool, install, stage


class _Replay:
    """The receiving side of `weight_group.send`: each broadcast fills the next bucket."""

    def __init__(self, manifest: Manifest, tensors: list[torch.Tensor]) -> None:
        self.buckets = [torch.cat([tensors[i].reshape(-1).view(torch.uint8) for i in index])
                        for index in buckets(manifest.tensors, manifest.bucket_bytes)]

    def broadcast(self, into: list[torch.Tensor], _options: Any) -> SimpleNamespace:
        into[0].copy_(self.buckets.pop(0))
        return SimpleNamespace(wait=lambda: None)


@pytest.fixture
def layout(monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.nn.Parameter]:
    """This rank holds `whole.weight`, the first half (rows) of `cut.weight`, and not
    `other.weight` (another expert-parallel rank's)."""
    held = {"whole.weight": torch.nn.Parameter(torch.zeros(4, 4)),
            "cut.weight": torch.nn.Parameter(torch.zeros(2, 4))}
    monkeypatch.setattr(hf, "local_tensors", lambda _model, _arch: iter(held.items()))
    monkeypatch.setattr(hf, "held_whole", lambda name, _local: name != "cut.weight")
    monkeypatch.setattr(hf, "shard", lambda name, full, _local:
                        full.chunk(2, 0)[0] if name == "cut.weight" else full)
    return held


def _version(seed: int) -> tuple[Manifest, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {"whole.weight": torch.randn(4, 4, generator=gen),
               "cut.weight": torch.randn(4, 4, generator=gen),
               "other.weight": torch.randn(4, 4, generator=gen)}
    # 64 bytes a tensor, 64-byte buckets: one bucket each
    manifest = Manifest(tuple(spec_of(n, t) for n, t in tensors.items()), seed, 64)
    return manifest, list(tensors.values())


def test_a_rank_keeps_only_its_slices(layout: dict[str, torch.nn.Parameter]) -> None:
    pool = BufferPool()
    manifest, tensors = _version(1)
    staged = stage(_Replay(manifest, tensors), manifest, torch.nn.Module(), TINY, pool,
                   torch.device("cpu"))
    assert staged.problem is None
    values = {id(p): v for p, v in staged.values}
    whole, cut = layout["whole.weight"], layout["cut.weight"]
    assert torch.equal(values[id(whole)], tensors[0])
    assert torch.equal(values[id(cut)], tensors[1][:2])
    # kept: only the bucket this rank holds whole; the other two went through one
    # scratch buffer, and only `cut`'s half was copied out of it
    assert [b.numel() for b in staged.kept] == [64]
    assert values[id(whole)].data_ptr() == staged.kept[0].data_ptr()
    assert pool.scratch is not None and pool.scratch.numel() == 64
    assert values[id(cut)].untyped_storage().nbytes() == 32
    install(staged, pool)
    assert torch.equal(whole, tensors[0]) and torch.equal(cut, tensors[1][:2])
    assert pool.live == staged.kept and pool.spare == []


def test_a_version_reuses_the_buffers_of_the_one_before_the_last(
        layout: dict[str, torch.nn.Parameter]) -> None:
    """The live weights are views of the last version's buffers; the version before's
    are free, and the next version is received into them (double buffering)."""
    pool = BufferPool()
    kept: list[int] = []
    for seed in (1, 2, 3):
        manifest, tensors = _version(seed)
        staged = stage(_Replay(manifest, tensors), manifest, torch.nn.Module(), TINY, pool,
                       torch.device("cpu"))
        install(staged, pool)
        kept.append(staged.kept[0].data_ptr())
        assert layout["whole.weight"].data_ptr() == kept[-1]
        assert torch.equal(layout["whole.weight"], tensors[0])
    assert kept[2] == kept[0] != kept[1]


def test_a_missing_tensor_is_named_and_nothing_changes(
        layout: dict[str, torch.nn.Parameter]) -> None:
    manifest, tensors = _version(1)
    short = Manifest(manifest.tensors[1:], 1, 64)
    staged = stage(_Replay(short, tensors[1:]), short, torch.nn.Module(), TINY, BufferPool(),
                   torch.device("cpu"))
    assert staged.problem == "version 1: whole.weight was not sent"
    assert torch.equal(layout["whole.weight"], torch.zeros(4, 4))
