"""The other side of `sft_sample_efficiency.py`: transformers' Qwen3MoeForCausalLM of
the tiny preset's parameter count, with a character tokenizer (what a user at this size
would pick), trained by a plain PyTorch loop on the same rows, steps and batch as
moerl's SFT, with the same optimizer and schedule:

- rows: the same (prompt, reference) pairs in the same order, [BOS] prompt response
  [EOS], loss on the response and EOS only (moerl's `data.sft.sft_batch` builds both
  sides' batches), the loss summed over the batch's loss tokens and divided by their
  count (moerl's per-token loss);
- optimizer: Adam with decoupled weight decay on matrices only (Megatron leaves norms
  and biases out), the same betas, eps and gradient clipping, and Megatron's own
  warm-up/cosine scheduler object driving it.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from _sft_tasks import Task, digit_positions

# Matched to the tiny preset (hidden 128, 4 layers, 4 heads of 32, a dense first layer of
# 512): its MoE layers hold 4 routed experts + 1 shared expert of 256, Qwen3-MoE has no
# shared expert, so 5 routed experts of 256, top-2. Embeddings are smaller (a ~100-entry
# vocabulary against 512), so the total is 5% under tiny's 2.06 M.
QWEN_SHAPE: dict[str, Any] = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    head_dim=32, intermediate_size=512, mlp_only_layers=[0], num_experts=5,
    num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
    max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6,
)


@dataclass(frozen=True)
class CharTokenizer:
    """Printable ASCII characters, then BOS, EOS and PAD."""

    alphabet: str = string.printable

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    @property
    def bos_id(self) -> int:
        return len(self.alphabet)

    @property
    def eos_id(self) -> int:
        return len(self.alphabet) + 1

    @property
    def pad_id(self) -> int:
        return len(self.alphabet) + 2

    def encode(self, text: str) -> list[int]:
        unknown = set(text) - set(self.alphabet)
        if unknown:
            raise ValueError(f"character tokenizer: no id for {sorted(unknown)!r}")
        return [self.alphabet.index(ch) for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.alphabet[i] for i in ids if i < len(self.alphabet))


def build_qwen(tok: CharTokenizer, seed: int, qk_norm: bool = True,
               qk_std: float | None = None) -> Any:
    """The model from `seed`; `qk_norm=False` drops Qwen3's per-head RMSNorms of queries
    and keys (a diagnostic: the architecture itself has them)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                            eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, **QWEN_SHAPE)
    model = Qwen3MoeForCausalLM(config)
    if not qk_norm:
        for layer in model.model.layers:
            layer.self_attn.q_norm = torch.nn.Identity()
            layer.self_attn.k_norm = torch.nn.Identity()
    if qk_std is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.normal_(0.0, qk_std)
                layer.self_attn.k_proj.weight.normal_(0.0, qk_std)
    return model


def build_deepseek(tok: CharTokenizer, seed: int, up_std: float | None = None,
                   unit_qk: bool = False, gains: tuple[float, float] | None = None) -> Any:
    """transformers' DeepseekV3ForCausalLM of the tiny preset's shape (a diagnostic: MLA
    with its latent norms, no MTP, one routing group, no expert-bias updates)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from moerl.models.arch import TINY
    from moerl.models.hf_mapping import hf_config_from_arch

    arch = TINY.replace(vocab_size=tok.vocab_size, router_num_groups=1, router_group_topk=1,
                        mtp_num_layers=0)
    config = hf_config_from_arch(arch, {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                                        "pad_token_id": tok.pad_id})
    for key in ("architectures", "model_type"):
        config.pop(key)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**config))
    if up_std is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_b_proj.weight.normal_(0.0, up_std)
                layer.self_attn.kv_b_proj.weight.normal_(0.0, up_std)
    if gains is not None:  # the q and kv latent norms' initial weights
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_a_layernorm.weight.fill_(gains[0])
                layer.self_attn.kv_a_layernorm.weight.fill_(gains[1])
    if unit_qk:  # queries and keys (not values) with unit-RMS entries at init
        arch_heads, nope, v = arch.num_attention_heads, arch.qk_head_dim, arch.v_head_dim
        with torch.no_grad():
            for layer in model.model.layers:
                att = layer.self_attn
                att.q_b_proj.weight.normal_(0.0, arch.q_lora_rank ** -0.5)
                kv_b = att.kv_b_proj.weight.view(arch_heads, nope + v, -1)
                kv_b[:, :nope].normal_(0.0, arch.kv_lora_rank ** -0.5)
                att.kv_a_proj_with_mqa.weight[arch.kv_lora_rank:].normal_(
                    0.0, arch.hidden_size ** -0.5)
    return model


HF_MODELS: dict[str, Any] = {
    "qwen3_moe": build_qwen,
    "qwen3_moe_no_qk_norm": lambda tok, seed: build_qwen(tok, seed, qk_norm=False),
    "hf_deepseek_v3": build_deepseek,
    "hf_deepseek_v3_up": lambda tok, seed: build_deepseek(tok, seed, up_std=0.125),
    "hf_deepseek_v3_unit_qk": lambda tok, seed: build_deepseek(tok, seed, unit_qk=True),
    "hf_deepseek_v3_gain6": lambda tok, seed: build_deepseek(tok, seed, gains=(6.0, 6.0)),
    "hf_deepseek_v3_gainq36": lambda tok, seed: build_deepseek(tok, seed, gains=(36.0, 1.0)),
    "qwen3_moe_no_qk_norm_unit_qk": lambda tok, seed: build_qwen(tok, seed, qk_norm=False,
                                                                qk_std=128 ** -0.5),
}


def build_adam(model: torch.nn.Module, optim: Any) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW and Megatron's scheduler for `optim` (a moerl OptimConfig); weight decay on
    matrices only, as Megatron's optimizer groups do."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    adam = torch.optim.AdamW(
        [{"params": matrices, "wd_mult": 1.0}, {"params": vectors, "wd_mult": 0.0}],
        lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
        weight_decay=optim.weight_decay)
    scheduler = OptimizerParamScheduler(
        adam, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr,
        min_lr=optim.min_lr, lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=optim.decay_steps, lr_decay_style="cosine",
        start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=optim.decay_steps, wd_incr_style="constant")
    return adam, scheduler


def train_steps(model: Any, adam: torch.optim.Optimizer, scheduler: Any, rows: Sequence[Any],
                first: int, stop: int, global_batch: int, seq_length: int, pad_id: int,
                clip_grad: float) -> None:
    """Steps `first` .. `stop - 1`, each on the next `global_batch` rows (cycled), as
    `trainer.sft.run_sft` takes them."""
    from moerl.data.sft import sft_batch

    model.train()
    for step in range(first, stop):
        start = step * global_batch
        chunk = [rows[(start + k) % len(rows)] for k in range(global_batch)]
        batch = sft_batch(chunk, seq_length, pad_id)
        logits = model(input_ids=batch.tokens).logits  # [b, s, vocab]
        per_token = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch.labels.flatten(), reduction="none")
        mask = batch.loss_mask.flatten()
        loss = (per_token * mask).sum() / mask.sum()
        adam.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        adam.step()
        scheduler.step(1)


@torch.no_grad()
def evaluate(model: Any, tok: CharTokenizer, held: Sequence[Task], max_tokens: int,
             seq_length: int) -> tuple[float, float]:
    """(greedy pass rate, mean loss on the references' digits) over `held`."""
    from moerl.data.sft import encode_example, sft_batch

    model.eval()
    examples = [encode_example(tok, t.prompt, t.reference) for t in held]  # type: ignore[arg-type]
    batch = sft_batch(examples, seq_length, tok.pad_id)
    logits = model(input_ids=batch.tokens).logits.float()  # [b, s, vocab]
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.labels,
                                                  reduction="none")  # [b, s]
    digits = [float(per_token[row, len(ex.prompt_ids) - 1 + i])
              for row, (ex, t) in enumerate(zip(examples, held, strict=True))
              for i in digit_positions(t)]
    passed = 0
    for ex, task in zip(examples, held, strict=True):
        ids = torch.tensor([ex.prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        passed += task.passes(tok.decode(out[0, ids.shape[1]:].tolist()))
    model.train()
    return passed / len(held), sum(digits) / max(1, len(digits))
