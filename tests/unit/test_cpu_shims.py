"""Each CPU shim is needed: the Megatron call it covers fails with the shim lifted
and works with it in place. Skipped where a GPU is present (no shims there)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from moerl.parallel import cpu_shims
from moerl.parallel.cpu_shims import SHIMS, apply_cpu_shims, shim_disabled

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims only without a GPU"),
    pytest.mark.usefixtures("single_process"),
]


def test_apply_is_idempotent() -> None:
    apply_cpu_shims()
    before = torch.cuda.current_device
    apply_cpu_shims()
    assert torch.cuda.current_device is before
    assert sorted(cpu_shims.applied()) == sorted(SHIMS)


def test_current_device() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def build() -> RotaryEmbedding:
        return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=False)

    with shim_disabled("current_device"), pytest.raises(RuntimeError):
        build()
    assert build().inv_freq.device.type == "cpu"


def test_streams() -> None:
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    def use_stream() -> None:
        SharedExpertMLP.stream = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.ones(2).sum()

    with shim_disabled("streams"), pytest.raises((RuntimeError, torch.AcceleratorError)):
        use_stream()
    use_stream()


def test_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    splits = torch.tensor([3, 1])
    with shim_disabled("split_sizes"):
        assert torch.is_tensor(token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True))
    moved = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(moved, np.ndarray) and moved.tolist() == [3, 1]


def test_causal_mask() -> None:
    from megatron.core.fusions import fused_softmax

    with shim_disabled("causal_mask"), pytest.raises(RuntimeError):
        fused_softmax.get_default_causal_mask(4)
    mask = fused_softmax.get_default_causal_mask(4)
    assert torch.equal(mask, torch.triu(torch.ones(4, 4), diagonal=1).bool())


def test_cuda_device_strings() -> None:
    from megatron.core.optimizer import clip_grads

    grads = [torch.full((4,), 2.0)]
    with shim_disabled("cuda_device_strings"), pytest.raises(RuntimeError):
        clip_grads.get_grad_norm_fp32(grads)
    assert clip_grads.get_grad_norm_fp32(grads) == pytest.approx(4.0)


def test_cuda_type_checks() -> None:
    from megatron.core.optimizer import clip_grads

    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.full((4,), 2.0)
    with shim_disabled("cuda_type_checks"), pytest.raises(AssertionError):
        clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    assert param.grad.tolist() == pytest.approx([0.5] * 4, rel=1e-5)
    assert torch.zeros(1).type() == "torch.FloatTensor"  # restored outside the call


def test_norm_sequence_parallel() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = types.SimpleNamespace(
        layernorm_zero_centered_gamma=False, persist_layer_norm=False, sequence_parallel=True,
        memory_efficient_layer_norm=False, normalization="RMSNorm",
    )
    with shim_disabled("norm_sequence_parallel"), pytest.raises(AssertionError):
        WrappedTorchNorm(config, 8)
    norm = WrappedTorchNorm(config, 8)
    assert all(p.sequence_parallel for p in norm.parameters())
    assert config.sequence_parallel  # the caller's config is untouched


def test_embedding_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.parallel.layout import ParallelLayout

    # As with pipeline stages and MTP: the embedding copy is synced at construction.
    monkeypatch.setattr(LanguageModule, "_is_in_embd_group", lambda self: True)
    arch = TINY.replace(num_layers=2, first_k_dense=1, mtp_num_layers=1)
    with shim_disabled("embedding_sync"), pytest.raises(RuntimeError):
        build_model(arch, ParallelLayout(), pipeline_model_parallel_size=2)
    build_model(arch, ParallelLayout(), pipeline_model_parallel_size=2)


def test_synchronize() -> None:
    # Megatron's batched p2p calls this after its sends/receives, which takes two
    # pipeline ranks to reach (the PP2 parity test does); the call itself is here.
    with shim_disabled("synchronize"), pytest.raises(RuntimeError):
        torch.cuda.synchronize()
    torch.cuda.synchronize()


def test_optimizer_state_gather() -> None:
    from moerl.checkpoint.sharded import optimizer_metadata
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.models.weights import sharded_model_state
    from moerl.parallel.layout import ParallelLayout
    from moerl.trainer.config import OptimConfig
    from moerl.trainer.optimizer import build_optimizer

    # A checkpoint of the distributed optimizer's state gathers it over the
    # data-parallel group after a `.cuda()` of each shard.
    layout = ParallelLayout(use_distributed_optimizer=True)
    trainable = build_optimizer(build_model(TINY.replace(num_layers=1), layout),
                                OptimConfig(), layout)
    for param in trainable.optimizer.get_parameters():
        param.grad = torch.zeros_like(param)
    trainable.optimizer.step()

    def state() -> object:
        model = sharded_model_state(list(trainable.model))
        return trainable.optimizer.sharded_state_dict(
            model, metadata=optimizer_metadata("fully_reshardable"))

    with shim_disabled("optimizer_state_gather"), pytest.raises(
            (RuntimeError, AssertionError, torch.AcceleratorError)):
        state()
    assert state()


def test_parallel_load_exchange() -> None:
    from megatron.core.dist_checkpointing import ShardedTensor, exchange_utils
    from megatron.core.dist_checkpointing.exchange_utils import ShardDistribution

    # A fully parallel load: this rank read a tensor another rank needs too, and
    # broadcasts it (over a one-rank group here, which is what one process can show;
    # the resume tests run the exchange on several ranks).
    read = ("a", (0,), (1,))
    metadata = {read: ShardedTensor.from_rank_offsets("a", torch.zeros(3)).without_data()}
    distribution = ShardDistribution({read: 0}, {read}, metadata, {read: [0, 1]})

    def exchange() -> dict[object, torch.Tensor]:
        out: dict[object, torch.Tensor] = exchange_utils.exchange_by_distribution(
            {read: torch.arange(3.0)}, {}, distribution, None, "broadcast")
        return out

    with shim_disabled("parallel_load_exchange"), pytest.raises(RuntimeError):
        exchange()
    assert exchange()[read].tolist() == [0.0, 1.0, 2.0]


def test_checkpoint_rng() -> None:
    from megatron.core.tensor_parallel.random import checkpoint

    x = torch.ones(3, requires_grad=True)

    def recomputed() -> torch.Tensor:
        out: torch.Tensor = checkpoint(lambda t: (t * 2).sum(), False, x)
        return out

    with shim_disabled("checkpoint_rng"), pytest.raises(RuntimeError):
        recomputed()
    recomputed().backward()
    assert x.grad is not None and x.grad.tolist() == [2.0, 2.0, 2.0]


def test_one_rank_buffer_sync() -> None:
    """A one-rank group's in-place gather or reduce issues no collective; anything
    else reaches the collective as before."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    one = torch.distributed.new_group([0])  # the test's world has one rank (gloo)
    calls: list[str] = []

    def gather(output: torch.Tensor, source: torch.Tensor, group: object = None,
               async_op: bool = False) -> None:
        calls.append("gather")
        output.copy_(source)

    collective = cpu_shims.skip_one_rank(gather)
    buffer = torch.arange(6.0)
    assert collective(buffer, buffer.view(-1), group=one) is None and calls == []
    other = torch.zeros(6)
    collective(other, buffer, group=one)
    assert calls == ["gather"] and other.tolist() == buffer.tolist()

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("coalesced a one-rank group")

    with cpu_shims.coalesce_one_rank(refuse)(one, async_ops=False) as handle:
        pass
    handle.wait()
    assert buffers.dist_all_gather_func.__wrapped__ is not None  # installed on this machine
