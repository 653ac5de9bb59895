"""Drafters: cheap guesses of a sample's next tokens, for the policy to verify.

`NgramDrafter` is prompt lookup: find the latest earlier occurrence of the
context's last n tokens (longest n first) and propose what followed it. Code edits
and agent observations repeat long spans of the prompt, so it is often right, and
it costs no forward pass. Its proposals are deterministic (q is a point mass).

`MTPDrafter` runs the model's own multi-token-prediction head (DeepSeek-V3's MTP,
Megatron's `MultiTokenPredictionLayer`, trained with the model). Depth d takes the
hidden state h (depth 0: the main decoder's output at the position before the last
known token; depth d > 0: the MTP output of depth d - 1) and the embedding of the
token after it, and gives logits for the token after that; its draft is sampled
from those logits with the sample's own temperature / top-k / top-p (greedy rows
take the argmax), and that distribution is the q of the acceptance rule. Drafts
chain: k drafts cost k MTP-layer calls, batched over the samples. Depths beyond the
model's `mtp_num_layers` reuse its last MTP layer. As in Megatron's own MTP
speculative decoding, each MTP call sees one position with no KV cache of its own,
so the MTP layer's attention reads only that position (in training it attends over
the sequence); this lowers acceptance, never exactness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core.models.gpt import GPTModel

from moerl.rollout.sampling import RowSampling
from moerl.rollout.speculative.verify import draw, policy_probs


@dataclass
class DraftRequest:
    """One sample that wants up to `num` (>= 1) drafts."""

    context: list[int]  # prompt + generated tokens; the last one is not in the KV cache yet
    num: int
    sampling: RowSampling
    hidden: torch.Tensor | None = None  # [H] decoder output before the last token (MTP)


@dataclass
class Draft:
    tokens: list[int]  # at most `num` of them; may be empty
    probs: torch.Tensor | None = None  # [len(tokens), V] the drafter's q; None = point masses


class Drafter(Protocol):
    """Proposes drafts for a batch of samples."""

    @property
    def needs_hidden(self) -> bool:
        """Whether requests must carry the decoder's hidden state."""
        ...

    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...


class NgramDrafter:
    """Prompt / n-gram lookup over each sample's own context."""

    needs_hidden = False

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup(r.context, r.num)) for r in requests]

    def lookup(self, context: list[int], num: int) -> list[int]:
        """What followed the latest earlier match of the longest matching suffix."""
        size = len(context)
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            suffix = context[size - n :]
            # Latest start first; a match may overlap the suffix (a repeating loop).
            for start in range(size - n - 1, -1, -1):
                if context[start : start + n] == suffix:
                    follow = context[start + n : start + n + num]
                    return follow
        return []


class MTPDrafter:
    """The model's MTP head, chained for several drafts (see the module docstring)."""

    needs_hidden = True

    def __init__(self, model: GPTModel) -> None:
        layers = int(model.config.mtp_num_layers or 0)
        if layers < 1 or getattr(model, "mtp", None) is None:
            raise ValueError("speculative.mode='mtp' needs a model built with mtp_num_layers "
                             ">= 1 (its multi-token-prediction head)")
        self.model = model
        self.layers = layers

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        ready = [i for i, r in enumerate(requests) if r.hidden is not None]
        drafts = [Draft([]) for _ in requests]
        if not ready:
            return drafts
        chosen = [requests[i] for i in ready]
        rows = [r.sampling for r in chosen]
        hidden = torch.stack([r.hidden for r in chosen if r.hidden is not None])[None]  # [1, R, H]
        device = hidden.device
        token = torch.tensor([[r.context[-1]] for r in chosen], device=device)  # [R, 1]
        position = torch.tensor([[len(r.context) - 1] for r in chosen], device=device)  # [R, 1]
        tokens: list[list[int]] = [[] for _ in chosen]
        probs: list[list[torch.Tensor]] = [[] for _ in chosen]
        for depth in range(max(r.num for r in chosen)):
            hidden, logits = self.model.compute_mtp_single_step(
                hidden, token, position, depth=min(depth, self.layers - 1))
            q = policy_probs(logits[0], rows)  # [R, V]
            for j, r in enumerate(chosen):
                if depth < r.num:
                    tokens[j].append(draw(q[j], r.sampling.generator))
                    probs[j].append(q[j])
            token = torch.tensor([[t[-1]] for t in tokens], device=device)
            position = position + 1
        for j, i in enumerate(ready):
            drafts[i] = Draft(tokens[j], torch.stack(probs[j]))
        return drafts


def make_drafter(mode: str, model: GPTModel, ngram_max: int = 4, ngram_min: int = 2) -> Drafter:
    if mode == "ngram":
        return NgramDrafter(ngram_max, ngram_min)
    if mode == "mtp":
        return MTPDrafter(model)
    raise ValueError(f"no drafter for speculative mode {mode!r}")
