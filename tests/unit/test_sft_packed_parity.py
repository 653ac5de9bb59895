"""Packed SFT rows train exactly like one example per row (one process, the tiny MoE).

Both models start from the same weights; one step over the same examples — one per
row with Megatron's local attention, or packed several per row on the ring
attention with document boundaries — must give the same loss (main + MTP) and the
same gradient for every parameter. One example has an empty prompt, so its first
label carries loss: MTP's roll must stop at the document before it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moerl.data.code_tasks import make_tasks
from moerl.data.sft import encode_example, pack_examples, packed_batch, sft_batch
from moerl.data.tokenizer import ByteTokenizer
from moerl.models.arch import TINY
from moerl.models.packed_mtp import roll_within_documents
from moerl.models.weights import unwrap_model
from moerl.parallel.groups import ParallelGroups
from moerl.trainer.config import SFTConfig
from moerl.trainer.optimizer import Trainable
from moerl.trainer.sft import build_sft_trainable
from moerl.trainer.step import StepMetrics, train_step

TOK = ByteTokenizer()
SEQ = 176


def test_roll_stays_inside_each_document() -> None:
    x = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    cu = torch.tensor([[0, 2, 5, 6], [0, 6, 6, 6]], dtype=torch.int32)
    rolled, total = roll_within_documents(x, cu)
    assert rolled.tolist() == [[2, 0, 4, 5, 0, 0], [8, 9, 10, 11, 12, 0]]
    assert int(total) == int(rolled.sum())


def _step(trainable: Trainable, batch: object, rows: int) -> StepMetrics:
    return train_step(trainable.model, trainable.optimizer, iter([batch]), num_microbatches=1,
                      micro_batch_size=rows, seq_length=SEQ, scheduler=trainable.scheduler)


def _grads(trainable: Trainable) -> dict[str, torch.Tensor]:
    model = unwrap_model(trainable.model[0])
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}


def test_packed_step_equals_one_example_per_row(single_process: ParallelGroups) -> None:
    # The sequence-wise balance loss is a function of the rows themselves: off here.
    arch = TINY.replace(aux_loss_coeff=0.0)
    tasks = make_tasks(11, seed=3)
    examples = [encode_example(TOK, t.prompt, t.reference) for t in tasks]
    examples.insert(4, encode_example(TOK, "", "    return 0\n"))  # loss from the first label
    cfg = SFTConfig(steps=1, global_batch=len(examples), micro_batch=len(examples),
                    seq_length=SEQ, lr=1e-3, warmup_steps=0)
    torch.manual_seed(0)
    plain = build_sft_trainable(arch, single_process.layout, cfg, single_process)
    packed = build_sft_trainable(arch, single_process.layout,
                                 dataclasses.replace(cfg, pack=True), single_process)
    unwrap_model(packed.model[0]).load_state_dict(unwrap_model(plain.model[0]).state_dict())

    rows = pack_examples(examples, SEQ)
    assert len(rows) < len(examples) / 2  # really packed
    ours = _step(packed, packed_batch([[examples[i] for i in r] for r in rows], SEQ, TOK.PAD),
                 len(rows))
    reference = _step(plain, sft_batch(examples, SEQ, TOK.PAD), len(examples))

    assert ours.num_tokens == reference.num_tokens
    assert ours.loss == pytest.approx(reference.loss, rel=1e-6)
    assert ours.grad_norm == pytest.approx(reference.grad_norm, rel=1e-5)
    got, want = _grads(packed), _grads(plain)
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    scale = max(float(g.abs().max()) for g in want.values())
    print(f"loss {ours.loss:.6f} vs {reference.loss:.6f}; max grad diff {worst:.2e} "
          f"(largest grad {scale:.2e})")
    assert worst <= 1e-6 * scale
