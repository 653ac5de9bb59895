"""One initial model for both sides of benchmarks/learning_vs_trl.py, run there as its
own process:

    python benchmarks/_shared_init.py <out_dir> <seed> [moerl overrides ...]

Builds the model `moerl train <overrides>` would build, its weights drawn as that run
draws them (`rl.seed` = <seed>), and writes them twice: `<out_dir>/megatron` (what
`moerl train init_weights=...` starts from) and `<out_dir>/hf` (a Hugging Face
DeepSeek-V3 directory: what transformers' DeepseekV3ForCausalLM loads). Then both
models compute the logits of one random batch, and the script fails unless they agree
to 1e-4 of the largest logit: the two sides start from the same function, not only the
same tensors. A router without expert bias (`model.router_expert_bias=false`) is
written with transformers' zero correction bias, which computes the same routing.

Not a benchmark (the leading underscore keeps it out of the smoke test's list).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _hf_models import token_ids

from moerl.config import load_run_config
from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.features import resolve_precision
from moerl.models.hf import gather_megatron, hf_tensors, write_safetensors
from moerl.models.hf_mapping import rules
from moerl.models.weights import save_weights
from moerl.parallel.groups import destroy_parallel, init_parallel

TOLERANCE = 1e-4  # of the largest logit; measured agreement is ~1e-7


def zero_expert_bias(meg: dict[str, torch.Tensor], arch: MoEArch) -> None:
    """The Hugging Face layout always has the router's correction bias: zeros where the
    Megatron model has none (`router_expert_bias=false`)."""
    for rule in rules(arch):
        if rule.megatron.endswith("router.expert_bias") and rule.megatron not in meg:
            meg[rule.megatron] = torch.zeros(arch.num_experts, dtype=torch.float32)


def write_hf(meg: dict[str, torch.Tensor], arch: MoEArch, out: Path) -> None:
    tensors, config = hf_tensors(meg, arch, token_ids())
    out.mkdir(parents=True)
    write_safetensors(tensors, out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_same_function(chunk: torch.nn.Module, hf_dir: Path, arch: MoEArch) -> float:
    """Largest logit difference between the Megatron chunk and the HF model, relative
    to the largest logit, on a (2, 24) batch of random token ids."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(256, (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    chunk.eval()
    with torch.no_grad():
        mine = chunk(ids, positions, None)  # (2, 24, vocab): one rank holds the vocabulary
        theirs = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
    return float((mine - theirs).abs().max() / theirs.abs().max())


def main(out_dir: str, seed: int, overrides: list[str]) -> None:
    cfg = load_run_config([*overrides, f"rl.seed={seed}"], world_size=1)
    if cfg.model.mtp_num_layers:
        raise SystemExit("model.mtp_num_layers must be 0: transformers' models have no MTP head")
    init_parallel(cfg.parallel, seed=seed)  # seeds the weights as `moerl train` does
    try:
        chunks = build_model(cfg.model, cfg.parallel, precision=resolve_precision(cfg.precision))
        out = Path(out_dir)
        save_weights(list(chunks), out / "megatron")
        meg = gather_megatron(list(chunks), cfg.model)
        zero_expert_bias(meg, cfg.model)
        write_hf(meg, cfg.model, out / "hf")
        gap = check_same_function(chunks[0], out / "hf", cfg.model)
    finally:
        destroy_parallel()
    print(f"shared init (seed {seed}): Megatron and transformers logits agree to {gap:.1e}")
    if gap > TOLERANCE:
        raise SystemExit(f"the two models compute different functions ({gap:.1e} > "
                         f"{TOLERANCE}): the Hugging Face mapping no longer fits the arch")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
