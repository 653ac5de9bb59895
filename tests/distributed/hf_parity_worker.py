"""Import a tiny HF DeepSeek-V3 under a layout, write its logits, export it back.

Run under torchrun (or as one plain process). Rank 0 writes `logits.pt` (full
vocabulary, gathered over tensor parallelism) and `import.json`: per rank, the bytes
its import read from the safetensors files, and whether every tensor it holds equals
the import that reads each tensor whole and cuts it. Every rank takes part in the
export to `<out>/hf`. `tiny_hf_checkpoint` builds the model the tests share.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

BATCH, SEQ = 2, 12


def tiny_hf_checkpoint(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random tiny DeepSeek-V3 saved with transformers: MLA with q-LoRA, one dense
    layer then MoE layers with 8 routed experts (2 groups, 1 selected) and a shared
    expert, sigmoid routing with a non-zero correction bias."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=128, rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
    with torch.no_grad():
        # Norms of ones and a zero bias would hide a mix-up of those tensors.
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn_like(tensor))
            elif tensor.dim() == 1:
                tensor.copy_(1 + 0.1 * torch.randn_like(tensor))
            elif tensor.dim() >= 2:
                tensor.copy_(0.05 * torch.randn_like(tensor))
    model.save_pretrained(out_dir)
    return out_dir


def tokens() -> torch.Tensor:
    return torch.randint(256, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def megatron_logits(chunk: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] from one model chunk (no pipeline), gathered over tp."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    chunk.eval()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = chunk(ids, positions, None)
        return gather_from_tensor_model_parallel_region(
            logits, group=ps.get_tensor_model_parallel_group())


def same_as_whole(hf_dir: Path, arch: Any, chunks: list[Any]) -> bool:
    """Does every tensor this rank holds equal the whole HF tensor read, converted and
    cut (the import before slices)?"""
    from moerl.models.hf import local_tensors, shard
    from moerl.models.hf_files import HFCheckpoint
    from moerl.models.hf_mapping import rules, to_megatron

    whole = HFCheckpoint(hf_dir)
    by_name = {r.megatron: r for r in rules(arch)}
    interleave = bool(whole.config.get("rope_interleave", True))
    return all(torch.equal(local, shard(name, to_megatron(by_name[name], whole, arch,
                                                          interleave), local))
               for chunk in chunks for name, local in local_tensors(chunk, arch))


def main() -> None:
    import torch.distributed as dist

    from moerl.models.hf import export_hf
    from moerl.models.hf_import import import_hf
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout

    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", default="{}")
    args = parser.parse_args()
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    degrees = json.loads(args.layout)
    layout = ParallelLayout(**degrees)
    layout.dp = world // (layout.tp * layout.pp * layout.cp)
    groups = init_parallel(layout, seed=3)
    arch, chunks, reader = import_hf(args.hf, layout)
    from moerl.models.hf import local_tensors

    held = sum(local.numel() for chunk in chunks for _, local in local_tensors(chunk, arch))
    report: list[Any] = [{"bytes_read": reader.bytes_read, "held_bytes": 4 * held,  # fp32 files
                          "same_as_whole": same_as_whole(args.hf, arch, chunks)}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine = report[0]
        report = [None] * dist.get_world_size()
        dist.all_gather_object(report, mine)
    if groups.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "import.json").write_text(json.dumps(report))
    if layout.pp == 1:  # one chunk holds the whole model: its output is the logits
        logits = megatron_logits(chunks[0], tokens())
        if groups.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(logits, args.out / "logits.pt")
    base = json.loads((args.hf / "config.json").read_text())
    export_hf(chunks, arch, args.out / "hf", base_config=base)
    destroy_parallel()


if __name__ == "__main__":
    main()
