"""Hugging Face DeepSeek-V3 family <-> Megatron-Core GPTModel: configs and tensor names.

Pure functions on whole (unsharded) state dicts; `models.hf` does the file IO and
the split over ranks. Megatron names here are *global*: `decoder.layers.{i}` is the
model's i-th decoder layer whatever the pipeline split, and
`mlp.experts.local_experts.{e}` is global expert e whatever the expert split.

Checkpoints of DeepSeek-V3, Kimi-K2 and Moonlight share this layout (Kimi-K2 and
Moonlight ship `model_type` "kimi_k2" / "deepseek_v3" with the same keys), so the
configs are read as plain `config.json` dicts, without `trust_remote_code`.

Two conventions that must match for the logits to agree:
- RoPE dims. Megatron's MLA always de-interleaves the rotary part of q and k
  (`mla_rotary_interleaved=True`: pairs (x0, x1), (x2, x3), ... rotate together),
  exactly what HF does with `rope_interleave=True` (the DeepSeek-V3 default). A
  checkpoint with `rope_interleave=False` pairs dim i with i + d/2, so its rotary
  rows are permuted into the interleaved order on import and back on export.
- Gated MLPs. Megatron's `linear_fc1` is [gate; up] stacked on the output dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moerl.models.arch import ArchError, MoEArch

Tensors = dict[str, torch.Tensor]
# A lazy reader: HF name -> tensor (so a caller can read only what it needs).
Reader = Callable[[str], torch.Tensor]

# Megatron suffix inside a decoder layer -> HF suffix inside `model.layers.{i}.`,
# for tensors copied as they are.
_LAYER_ONE_TO_ONE: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
# Tensors whose rotary rows follow the checkpoint's RoPE layout.
_ROPE_ROWS: dict[str, str] = {
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
}
_MTP_ONE_TO_ONE: dict[str, str] = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}


def _get(config: Mapping[str, Any] | Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def rope_parameters_of(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """The checkpoint's RoPE parameters as transformers reads them: the legacy
    `rope_scaling` dict when it is set, else `rope_parameters` (transformers 5), with
    `rope_theta` from that dict or else from the top level."""
    params = dict(_get(config, "rope_scaling") or _get(config, "rope_parameters") or {})
    params.setdefault("rope_theta", _get(config, "rope_theta") or 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


# Keys of a YaRN `rope_scaling` / `rope_parameters` dict that `MoEArch` models; the
# others are refused unless they hold the value that changes nothing.
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
_NEUTRAL = {"truncate": (True,), "attention_factor": (None,), "partial_rotary_factor": (None, 1)}


def _rope_fields(config: Mapping[str, Any] | Any, max_positions: int) -> dict[str, Any]:
    """MoEArch's rope fields for the checkpoint's RoPE; an error names what is unsupported."""
    params = rope_parameters_of(config)
    kind = params["rope_type"]
    key = "rope_scaling" if _get(config, "rope_scaling") else "rope_parameters"
    if params.get("partial_rotary_factor") not in _NEUTRAL["partial_rotary_factor"]:
        raise ArchError(f"hf: {key}.partial_rotary_factor="
                        f"{params['partial_rotary_factor']} is not supported (must be 1)")
    fields: dict[str, Any] = {"rotary_base": float(params["rope_theta"])}
    if kind in (None, "default"):
        return fields
    if kind != "yarn":
        raise ArchError(f"hf: {key}.rope_type={kind!r} is not supported; the model implements "
                        "plain RoPE ('default') and 'yarn'")
    for name, value in params.items():
        if name in _YARN_KEYS:
            continue
        if name not in _NEUTRAL:
            raise ArchError(f"hf: {key}.{name} is not supported for YaRN (known keys: "
                            f"{', '.join(sorted(_YARN_KEYS | set(_NEUTRAL)))})")
        if value not in _NEUTRAL[name]:
            raise ArchError(f"hf: {key}.{name}={value!r} is not supported; Megatron's YaRN "
                            f"computes it as {name}={_NEUTRAL[name][0]!r}")
    original = int(params.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor")
    # transformers: a missing factor is max_position_embeddings / original; a missing
    # (or 0) beta_fast / beta_slow is 32 / 1; missing mscales count as 0 (unused).
    fields.update(
        rope_scaling="yarn",
        yarn_factor=float(factor if factor is not None else max_positions / original),
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(params.get("beta_fast") or 32.0),
        yarn_beta_slow=float(params.get("beta_slow") or 1.0),
        yarn_mscale=float(params.get("mscale") or 0.0),
        yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )
    return fields


def _hf_rope(arch: MoEArch) -> dict[str, Any]:
    """config.json's RoPE keys for `arch`: `rope_parameters` (transformers 5) and the
    legacy `rope_theta` + `rope_scaling` (transformers 4, DeepSeek's own code), which agree."""
    if arch.rope_scaling != "yarn":
        return {"rope_theta": arch.rotary_base, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": arch.rotary_base}}
    yarn = {
        "factor": arch.yarn_factor,
        "original_max_position_embeddings": arch.yarn_original_max_position_embeddings,
        "beta_fast": arch.yarn_beta_fast,
        "beta_slow": arch.yarn_beta_slow,
        "mscale": arch.yarn_mscale,
        "mscale_all_dim": arch.yarn_mscale_all_dim,
    }
    return {"rope_theta": arch.rotary_base,
            "rope_scaling": {"type": "yarn", "rope_type": "yarn", **yarn},
            "rope_parameters": {"rope_type": "yarn", "rope_theta": arch.rotary_base, **yarn}}


def arch_from_hf_config(config: Mapping[str, Any] | Any, name: str | None = None) -> MoEArch:
    """`MoEArch` of a DeepSeek-V3-family `config.json` (a dict or a transformers config).

    Refuses settings the Megatron model computes differently (so an import never
    silently changes the function): softmax routing without `norm_topk_prob`, and a
    group score other than HF's "sum of the top-2 experts of each group".
    """
    n_group = int(_get(config, "n_group", 1) or 1)
    topk_group = int(_get(config, "topk_group", 1) or 1)
    topk = int(_get(config, "num_experts_per_tok"))
    if not _get(config, "norm_topk_prob", True):
        raise ArchError("hf: norm_topk_prob=false is not supported (Megatron normalises "
                        "sigmoid top-k weights)")
    if n_group > 1 and topk // topk_group != 2:
        raise ArchError(
            f"hf: num_experts_per_tok // topk_group = {topk // topk_group}; Megatron scores a "
            "group by its top (topk // group_topk) experts, HF by its top 2: they must agree"
        )
    if _get(config, "attention_bias", False):
        raise ArchError("hf: attention_bias=true is not supported (the model has no biases)")
    layers = int(_get(config, "num_hidden_layers"))
    q_lora = _get(config, "q_lora_rank")
    max_positions = int(_get(config, "max_position_embeddings", 4096))
    return MoEArch(
        name=name or str(_get(config, "model_type", "hf")),
        num_layers=layers,
        hidden_size=int(_get(config, "hidden_size")),
        num_attention_heads=int(_get(config, "num_attention_heads")),
        vocab_size=int(_get(config, "vocab_size")),
        max_position_embeddings=max_positions,
        attention="mla",
        latent_norms=True,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(_get(config, "kv_lora_rank")),
        qk_head_dim=int(_get(config, "qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(_get(config, "qk_rope_head_dim")),
        v_head_dim=int(_get(config, "v_head_dim")),
        **_rope_fields(config, max_positions),
        ffn_hidden_size=int(_get(config, "intermediate_size")),
        first_k_dense=min(int(_get(config, "first_k_dense_replace", 0)), layers),
        num_experts=int(_get(config, "n_routed_experts")),
        moe_ffn_hidden_size=int(_get(config, "moe_intermediate_size")),
        moe_router_topk=topk,
        num_shared_experts=int(_get(config, "n_shared_experts", 0) or 0),
        router_score="sigmoid",
        router_num_groups=n_group,
        router_group_topk=topk_group,
        router_topk_scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)),
        router_expert_bias=True,
        mtp_num_layers=int(_get(config, "num_nextn_predict_layers", 0) or 0),
        norm_epsilon=float(_get(config, "rms_norm_eps", 1e-6)),
        untie_embeddings=not _get(config, "tie_word_embeddings", False),
    )


def hf_config_from_arch(arch: MoEArch, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A `config.json` dict for `arch`. Fields of `base` the arch does not describe
    (token ids, dtype, rope_interleave) are kept as they are; RoPE (YaRN included)
    comes from the arch."""
    if arch.attention != "mla":
        raise ArchError("hf: only MLA (DeepSeek-V3 family) architectures can be exported")
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "rope_interleave": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "norm_topk_prob": True,
    }
    config.update(base or {})
    config.update(_hf_rope(arch))
    config.update(
        num_hidden_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_attention_heads,
        vocab_size=arch.vocab_size,
        max_position_embeddings=arch.max_position_embeddings,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_nope_head_dim=arch.qk_head_dim,
        qk_rope_head_dim=arch.qk_pos_emb_head_dim,
        v_head_dim=arch.v_head_dim,
        intermediate_size=arch.ffn_hidden_size,
        first_k_dense_replace=arch.first_k_dense,
        n_routed_experts=arch.num_experts,
        moe_intermediate_size=arch.moe_ffn_hidden_size,
        num_experts_per_tok=arch.moe_router_topk,
        n_shared_experts=arch.num_shared_experts,
        n_group=arch.router_num_groups or 1,
        topk_group=arch.router_group_topk or 1,
        routed_scaling_factor=arch.router_topk_scaling_factor,
        num_nextn_predict_layers=arch.mtp_num_layers,
        rms_norm_eps=arch.norm_epsilon,
        tie_word_embeddings=not arch.untie_embeddings,
    )
    return config


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of.

    kind "copy": the same tensor; "rope": the same tensor with its rotary rows
    reordered (rope_interleave=False checkpoints only); "glu": [gate; up] stacked.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str = "copy"


def _layer_rules(arch: MoEArch, mp: str, hp: str, is_moe: bool) -> Iterator[Rule]:
    for meg, hf in _LAYER_ONE_TO_ONE.items():
        if arch.q_lora_rank is None and ("q_down" in meg or "q_layernorm" in meg):
            continue
        yield Rule(mp + meg, (hp + hf,))
    q = "linear_q_up_proj" if arch.q_lora_rank is not None else "linear_q_proj"
    for meg, hf in _ROPE_ROWS.items():
        if "linear_q" in meg and q not in meg:
            continue
        yield Rule(mp + meg, (hp + hf,), "rope")
    if not is_moe:
        yield from _mlp_rules(mp + "mlp.", hp + "mlp.")
        return
    yield Rule(mp + "mlp.router.weight", (hp + "mlp.gate.weight",))
    yield Rule(mp + "mlp.router.expert_bias", (hp + "mlp.gate.e_score_correction_bias",))
    for e in range(arch.num_experts):
        yield from _mlp_rules(f"{mp}mlp.experts.local_experts.{e}.", f"{hp}mlp.experts.{e}.")
    if arch.num_shared_experts:
        yield from _mlp_rules(mp + "mlp.shared_experts.", hp + "mlp.shared_experts.")


def _mlp_rules(mp: str, hp: str) -> Iterator[Rule]:
    yield Rule(mp + "linear_fc1.weight", (hp + "gate_proj.weight", hp + "up_proj.weight"), "glu")
    yield Rule(mp + "linear_fc2.weight", (hp + "down_proj.weight",))


def rules(arch: MoEArch) -> list[Rule]:
    """Every tensor of the Megatron model (global names) and where it comes from in HF."""
    out = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
           Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if arch.untie_embeddings:
        out.append(Rule("output_layer.weight", ("lm_head.weight",)))
    for i in range(arch.num_layers):
        out += _layer_rules(arch, f"decoder.layers.{i}.", f"model.layers.{i}.",
                            arch.is_moe_layer(i))
    for j in range(arch.mtp_num_layers):
        # DeepSeek stores MTP layer j as decoder layer num_layers + j; Megatron's MTP
        # layer reuses the last decoder layer's spec (MoE or dense).
        mp, hp = f"mtp.layers.{j}.", f"model.layers.{arch.num_layers + j}."
        out += [Rule(mp + m, (hp + h,)) for m, h in _MTP_ONE_TO_ONE.items()]
        out += _layer_rules(arch, mp + "mtp_model_layer.", hp,
                            arch.is_moe_layer(arch.num_layers - 1))
    return out


def mtp_copies(arch: MoEArch) -> dict[str, str]:
    """HF names of the MTP layers' embedding and head -> the Megatron tensor they copy.

    DeepSeek's checkpoints repeat them in each MTP layer; Megatron shares the main
    ones, so import ignores these and export writes the copies back.
    """
    out: dict[str, str] = {}
    for j in range(arch.mtp_num_layers):
        hp = f"model.layers.{arch.num_layers + j}."
        out[hp + "embed_tokens.weight"] = "embedding.word_embeddings.weight"
        out[hp + "shared_head.head.weight"] = (
            "output_layer.weight" if arch.untie_embeddings else "embedding.word_embeddings.weight")
    return out


def rope_perm(arch: MoEArch, rule: Rule, rows: int) -> torch.Tensor:
    """Row order taking half-split rotary rows (a0..a_{d/2-1}, b0..) to interleaved
    (a0, b0, a1, b1, ...), which Megatron's de-interleave undoes.

    q: rows = heads * (nope + rope), rope last in each head; kv_down: [kv_lora | rope].
    """
    d = arch.qk_pos_emb_head_dim
    block = arch.kv_lora_rank + d if "kv_down" in rule.megatron else arch.qk_head_dim + d
    inner = torch.arange(block)
    rope = inner[block - d:].clone()
    inner[block - d:] = torch.stack([rope[: d // 2], rope[d // 2:]], dim=1).reshape(d)
    return torch.cat([inner + start for start in range(0, rows, block)])


def to_megatron(rule: Rule, read: Reader, arch: MoEArch, rope_interleave: bool) -> torch.Tensor:
    """The Megatron tensor of `rule`, read from the HF checkpoint."""
    if rule.kind == "glu":
        return torch.cat([read(name) for name in rule.hf])
    tensor = read(rule.hf[0])
    if rule.kind == "rope" and not rope_interleave:
        tensor = tensor[rope_perm(arch, rule, tensor.shape[0])]
    return tensor


def to_hf(rule: Rule, tensor: torch.Tensor, arch: MoEArch, rope_interleave: bool) -> Tensors:
    """The HF tensor(s) of `rule` from the whole Megatron tensor."""
    if rule.kind == "glu":
        gate, up = tensor.chunk(2)
        return {rule.hf[0]: gate, rule.hf[1]: up}
    if rule.kind == "rope" and not rope_interleave:
        tensor = tensor[torch.argsort(rope_perm(arch, rule, tensor.shape[0]))]
    return {rule.hf[0]: tensor}


def hf_to_megatron(read: Reader, arch: MoEArch, rope_interleave: bool = True) -> Tensors:
    """The whole Megatron state dict (global names) from an HF checkpoint reader."""
    return {r.megatron: to_megatron(r, read, arch, rope_interleave) for r in rules(arch)}


def megatron_to_hf(meg: Mapping[str, torch.Tensor], arch: MoEArch,
                   rope_interleave: bool = True) -> Tensors:
    """The inverse of `hf_to_megatron`, plus the MTP layers' copies of embedding and head."""
    out: Tensors = {}
    for rule in rules(arch):
        out.update(to_hf(rule, meg[rule.megatron], arch, rope_interleave))
    out.update({hf: meg[m] for hf, m in mtp_copies(arch).items()})
    return out
