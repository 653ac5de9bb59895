"""The continuous engine's KV cache: fixed-size blocks of token slots, shared by refcount.

Memory is one tensor per kind, allocated once: for MLA the latent of every slot of
every layer, [layers, blocks * block_size, kv_lora_rank + rope]; for GQA keys and
values, [layers, 2, blocks * block_size, groups, head_dim] (`kv_size` gives the
widths). A sequence owns a list of blocks; its token at position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Blocks are reference
counted: the copies of one prompt share its full blocks (`rollout.prefix_share`), and
a block is free again when its last holder lets go.

Block 0 is never handed out: padded key positions read it (masked) and an idle rank's
stand-in token writes it, so neither can touch a sequence's slots. Attention reads whole
blocks, a sequence's last one past its length too (masked): a block is zeroed when it is
handed out, so what is read there is finite (a masked NaN would still poison the row
through the value product).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moerl.models.arch import MoEArch
from moerl.rollout.kv_size import gqa_head_dim, kv_groups_per_rank

NULL_BLOCK = 0


@dataclass(frozen=True)
class CacheSpec:
    """What one token of one layer holds on this rank."""

    latent: int  # MLA: kv_lora_rank + qk_pos_emb_head_dim; 0 for GQA
    groups: int = 0  # GQA: key/value groups on this rank
    head_dim: int = 0  # GQA

    @classmethod
    def of(cls, arch: MoEArch, tp: int = 1) -> CacheSpec:
        if arch.attention == "mla":
            return cls(arch.kv_lora_rank + arch.qk_pos_emb_head_dim)
        return cls(0, kv_groups_per_rank(arch, tp), gqa_head_dim(arch))

    @classmethod
    def of_model(cls, model: Any) -> CacheSpec:
        """What `model`'s layers (a `GPTModel`'s) cache on this rank (its attention shapes)."""
        config = model.config
        if config.multi_latent_attention:
            return cls(config.kv_lora_rank + config.qk_pos_emb_head_dim)
        attention = model.decoder.layers[0].self_attention
        return cls(0, attention.num_query_groups_per_partition,
                   attention.hidden_size_per_attention_head)

    @property
    def elements(self) -> int:
        """Elements per token and layer (`kv_size.kv_elements_per_token_layer`)."""
        return self.latent or 2 * self.groups * self.head_dim


class BlockPool:
    """Reference-counted block ids; block 0 is reserved."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._refs[NULL_BLOCK] = 1
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks, or None (nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} is not held"
            self._refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} released twice"
            if self._refs[block] == 0:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]


class PagedKVCache:
    """The slots of every layer on this rank, and the block pool that hands them out."""

    def __init__(self, spec: CacheSpec, layers: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.spec, self.layers, self.block_size = spec, layers, block_size
        self.pool = BlockPool(num_blocks)
        slots = num_blocks * block_size
        if spec.latent:
            # [layers, slots, latent]: the kv latent (after its norm), then the rotary key
            self.store = torch.empty(layers, slots, spec.latent, dtype=dtype, device=device)
        else:
            # [layers, 2 (key, value), slots, groups, head_dim]
            self.store = torch.empty(layers, 2, slots, spec.groups, spec.head_dim,
                                     dtype=dtype, device=device)
        if device != "meta" and slots:
            # Padded key positions read block 0: keep it finite (0 x NaN would poison a row).
            self.null_slots().zero_()

    @classmethod
    def sized(cls, spec: CacheSpec, layers: int, budget_bytes: float, block_size: int,
              dtype: torch.dtype, device: torch.device | str) -> PagedKVCache:
        """As many blocks as `budget_bytes` hold (block 0 included)."""
        width = torch.empty((), dtype=dtype).element_size()
        per_block = layers * spec.elements * block_size * width
        blocks = int(budget_bytes // per_block)
        if blocks < 2:
            raise ValueError(f"kv_cache_gb: {budget_bytes / 2**30:.3g} GiB holds {blocks} block(s) "
                             f"of {block_size} tokens ({per_block} bytes each); raise it")
        return cls(spec, layers, blocks, block_size, dtype, device)

    def null_slots(self) -> torch.Tensor:
        if self.spec.latent:
            return self.store[:, : self.block_size]
        return self.store[:, :, : self.block_size]

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes allocated per cached token, every layer (`kv_size.kv_bytes_per_token`)."""
        return self.nbytes // (self.pool.num_blocks * self.block_size)

    @property
    def token_capacity(self) -> int:
        return self.pool.usable * self.block_size

    def layer(self, index: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s slots: MLA [slots, latent]; GQA (keys, values) [slots, groups, dim]."""
        if self.spec.latent:
            return self.store[index]
        return self.store[index, 0], self.store[index, 1]

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero every layer's slots of `blocks` (freshly handed out)."""
        if not blocks:
            return
        index = torch.tensor(blocks, device=self.store.device)
        if self.spec.latent:
            by_block = self.store.view(self.layers, -1, self.block_size, self.spec.latent)
            by_block.index_fill_(1, index, 0)
        else:
            by_block = self.store.view(self.layers, 2, -1, self.block_size, self.spec.groups,
                                       self.spec.head_dim)
            by_block.index_fill_(2, index, 0)

    def copy_block(self, source: int, target: int) -> None:
        """Every layer's slots of block `source` into block `target` (copy on write)."""
        size = self.block_size
        src = slice(source * size, (source + 1) * size)
        dst = slice(target * size, (target + 1) * size)
        if self.spec.latent:
            self.store[:, dst] = self.store[:, src]
        else:
            self.store[:, :, dst] = self.store[:, :, src]
