"""Rotary embeddings at arbitrary positions: the model's own frequencies, looked up per token.

Megatron's attention rotates a [s, b, heads, dim] block whose positions are 0..s-1 (or
an offset); a continuous step holds tokens of many sequences at unrelated positions.
The table takes the frequencies from the model's rotary module once (YaRN's mscale
included), and each step gathers cos and sin for its tokens' positions. The rotation
is Megatron's (`rope_utils._apply_rotary_pos_emb_bshd`): MLA first de-interleaves
the rotary dims (even ones, then odd ones), then t * cos + rotate_half(t) * sin; the
equal-logits tests hold the two equal.
"""

from __future__ import annotations

import torch


class RopeTable:
    """cos and sin [positions, dim] of a rotary module, times its mscale."""

    def __init__(self, rotary: torch.nn.Module, max_positions: int, *, mla: bool,
                 interleaved: bool = False) -> None:
        emb = rotary(max_positions)
        mscale = 1.0
        if isinstance(emb, tuple):  # YaRN: (frequencies, mscale)
            emb, mscale = emb
        freqs = emb.reshape(emb.shape[0], emb.shape[-1]).float()  # [P, dim]
        self.cos = torch.cos(freqs) * mscale
        self.sin = torch.sin(freqs) * mscale
        self.dim = freqs.shape[-1]
        self.mla = mla
        self.interleaved = interleaved
        self._cos = self._sin = torch.empty(0)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """Take this step's positions [T]; `rotate` then applies them."""
        self._cos = self.cos[positions].to(dtype)[:, None, :]  # [T, 1, dim]
        self._sin = self.sin[positions].to(dtype)[:, None, :]

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """[T, heads, d] (d >= dim; the dims past `dim` pass unrotated) at this step's positions."""
        rot, rest = t[..., : self.dim], t[..., self.dim:]
        if self.mla:  # MLA's checkpoints interleave the rotary dims
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        out = rot * self._cos + _rotate_half(rot, self.interleaved) * self._sin
        return torch.cat((out, rest), dim=-1) if rest.numel() else out


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1)
    return pairs.flatten(-2)
