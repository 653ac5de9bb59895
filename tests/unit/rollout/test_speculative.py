"""Speculative decoding leaves the policy's tokens, distribution and logprobs unchanged."""

from __future__ import annotations

import torch
from conftest import VOCAB, full_logits
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.gpt import GPTModel

from moerl.data.tokenizer import ByteTokenizer
from moerl.rollout.engine import EngineOptions, MegatronEngine
from moerl.rollout.sampling import RowSampling
from moerl.rollout.speculative.config import SpeculativeConfig
from moerl.rollout.speculative.drafters import Draft, DraftRequest, NgramDrafter
from moerl.rollout.speculative.metrics import speculation_metrics
from moerl.rollout.speculative.verify import CachedPolicy, accept_drafts, policy_probs
from moerl.rollout.speculative_decode import SpeculativeDecoder
from moerl.rollout.static_decode import DecodeRow, open_batch
from moerl.rollout.types import GenerationRequest, Sample, SamplingParams

# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def _engine(model: GPTModel, **spec: object) -> MegatronEngine:
    options = EngineOptions(max_batch=8, speculative=SpeculativeConfig(**spec))
    return MegatronEngine(model, ByteTokenizer(), 1024, options)


def _prompts() -> list[list[int]]:
    """24 prompts: code-like and agent-like text that repeats itself, and random bytes."""
    texts = [b"def f(x):\n    return x + 1\n\ndef g(x):\n    return", b"ls -la\nls -la\nls",
             b"for i in range(10): print(i)\nfor i in range(", b"Observation: ok\nAction: run\n"
             b"Observation: ok\nAction:", b"abcabcabcabc", b"Hi", b"x = x + 1; x = x"]
    gen = torch.Generator().manual_seed(0)
    randoms = [torch.randint(0, 256, (int(n),), generator=gen).tolist()
               for n in torch.randint(2, 30, (24 - len(texts),), generator=gen)]
    return [list(t) for t in texts] + randoms


def _greedy_requests() -> list[GenerationRequest]:
    return [GenerationRequest(tuple(p), SamplingParams(max_tokens=6 + (i * 7) % 19,
                                                       temperature=0, ignore_eos=True))
            for i, p in enumerate(_prompts())]


class OracleDrafter:
    """Proposes the known greedy continuation with every third-or-so draft corrupted:
    many accepted runs of different lengths in one batch (rows ahead, rollbacks)."""

    needs_hidden = False

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers
        self.gen = torch.Generator().manual_seed(5)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            ctx = tuple(r.context)
            prompt = next(p for p in self.answers if ctx[: len(p)] == p)
            done = len(ctx) - len(prompt)
            tokens = list(self.answers[prompt][done : done + r.num])
            for i in range(len(tokens)):
                if torch.rand((), generator=self.gen) < 0.3:
                    tokens[i] = (tokens[i] + 1) % VOCAB
            drafts.append(Draft(tokens))
        return drafts


def test_greedy_identical_for_every_drafter(engine: MegatronEngine, model: GPTModel) -> None:
    requests = _greedy_requests()
    plain = engine.generate(requests)
    answers = {tuple(r.prompt_token_ids): list(g[0].token_ids) for r, g in zip(requests, plain,
                                                                              strict=True)}
    for spec in ({"mode": "ngram"}, {"mode": "mtp", "num_draft_tokens": 2},
                 {"mode": "ngram", "adaptive": True}, {"mode": "ngram", "num_draft_tokens": 5}):
        fast = _engine(model, **spec)
        if spec.get("num_draft_tokens") == 5:  # the oracle stands in for a strong drafter
            assert isinstance(fast._decoder, SpeculativeDecoder)
            fast._decoder.drafter = OracleDrafter(answers)
        groups = fast.generate(requests)
        for want, got in zip(plain, groups, strict=True):
            assert got[0].token_ids == want[0].token_ids, spec
            diff = torch.tensor(got[0].logprobs) - torch.tensor(want[0].logprobs)
            assert diff.abs().max().item() < 1e-5, spec
        metrics = speculation_metrics(groups)
        assert metrics["rollout/spec/samples"] == len(requests)
        if spec.get("num_draft_tokens") == 5:
            assert metrics["rollout/spec/mean_accepted_length"] > 2.0  # the oracle pays off
        if spec["mode"] == "ngram" and "adaptive" not in spec:
            assert metrics["rollout/spec/acceptance_rate"] > 0.2  # repeats get copied


def test_acceptance_rule_reproduces_p() -> None:
    """Pure maths: accepted-or-resampled tokens have distribution p, for a sampled
    draft (q a distribution) and a deterministic one (q a point mass)."""
    p = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05, 0.0], [1 / 6] * 6])  # [draft, bonus]
    q = torch.tensor([0.1, 0.1, 0.5, 0.0, 0.2, 0.1])
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    for point_mass in (False, True):
        counts = torch.zeros(6)
        for _ in range(n):
            x = 2 if point_mass else int(torch.multinomial(q, 1, generator=gen))
            probs = None if point_mass else q[None]
            accepted, extra = accept_drafts(p, [x], probs, gen)
            counts[x if accepted else extra] += 1
        expected = p[0] * n
        support = expected > 0
        assert counts[~support].sum() == 0
        chi2 = ((counts - expected)[support] ** 2 / expected[support]).sum().item()
        assert chi2 < CHI2_999[int(support.sum()) - 1], (point_mass, counts)


def _two_token_probs(model: GPTModel, prompt: list[int], params: SamplingParams
                     ) -> dict[tuple[int, int], float]:
    """Exact probability of each first-two-token pair under the sampler's distribution."""
    row = RowSampling.make(params, 0, 0)
    first = policy_probs(full_logits(model, torch.tensor([prompt]))[:, -1], [row])[0]
    joint = {}
    for a in torch.nonzero(first).flatten().tolist():
        logits = full_logits(model, torch.tensor([[*prompt, a]]))[:, -1]
        second = policy_probs(logits, [row])[0]
        for b in torch.nonzero(second).flatten().tolist():
            joint[(a, b)] = float(first[a] * second[b])
    return joint


class FixedDrafter:
    """A deterministic drafter: proposes `table[last token]` (point-mass q)."""

    needs_hidden = False

    def __init__(self, table: dict[int, int]) -> None:
        self.table = table

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([self.table.get(r.context[-1], 0)]) for r in requests]


def test_sampled_sequences_keep_the_policy_distribution(model: GPTModel) -> None:
    """The first two tokens (the second always a verified draft) over 2000 samples
    against their exact probabilities, for the MTP head's sampled drafts and for a
    deterministic drafter, at two temperatures."""
    prompt = list(b"for i in range(3): for")
    for mode, temperature, top_k in (("mtp", 1.3, 8), ("ngram", 0.8, 4)):
        params = SamplingParams(max_tokens=2, temperature=temperature, top_k=top_k, n=2000,
                                seed=int(temperature * 10), ignore_eos=True)
        joint = _two_token_probs(model, prompt, params)
        fast = _engine(model, mode=mode, num_draft_tokens=1)
        if mode == "ngram":  # draft the second-likeliest second token: often right, often not
            table = {}
            for a in {a for a, _ in joint}:
                seconds = sorted((b for x, b in joint if x == a), key=lambda b: -joint[(a, b)])
                table[a] = seconds[min(1, len(seconds) - 1)]
            assert isinstance(fast._decoder, SpeculativeDecoder)
            fast._decoder.drafter = FixedDrafter(table)
        groups = fast.generate([GenerationRequest(tuple(prompt), params)])
        rate = speculation_metrics(groups)["rollout/spec/acceptance_rate"]
        # Both branches of the rule ran, each for at least 10 samples (the untrained MTP
        # head's top-8 barely overlaps the main head's: ~1.6% of its drafts are kept).
        assert 10 <= rate * params.n <= params.n - 10, (mode, rate)
        counts: dict[tuple[int, int], int] = {}
        for s in groups[0]:
            pair = (s.token_ids[0], s.token_ids[1])
            assert pair in joint, pair
            counts[pair] = counts.get(pair, 0) + 1
        cells = [k for k, v in joint.items() if v * params.n >= 5]  # chi-square's usual rule
        expected = torch.tensor([joint[k] * params.n for k in cells])
        seen = torch.tensor([float(counts.get(k, 0)) for k in cells])
        chi2 = ((seen - expected) ** 2 / expected).sum().item()
        assert chi2 < CHI2_999[min(len(cells) - 1, 8)] * (len(cells) - 1) / min(len(cells) - 1, 8)
        assert speculation_metrics(groups)["rollout/spec/samples"] == params.n


def test_sampled_logprobs_equal_full_forward(model: GPTModel) -> None:
    prompt = list(b"ab ab ab ab")
    for mode, logprob_mode in (("ngram", "policy"), ("mtp", "sampling")):
        params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, n=3,
                                logprob_mode=logprob_mode, ignore_eos=True)
        for sample in _engine(model, mode=mode, adaptive=True).generate(
                [GenerationRequest(tuple(prompt), params)])[0]:
            tokens = torch.tensor([prompt + list(sample.token_ids)])
            logits = full_logits(model, tokens[:, :-1])[0, len(prompt) - 1 :]  # [N, V]
            scale = 0.7 if logprob_mode == "sampling" else 1.0
            expected = torch.log_softmax(logits / scale, -1).gather(
                1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
            assert (torch.tensor(sample.logprobs) - expected).abs().max().item() < 1e-5


def _cache(policy: CachedPolicy, upto: int) -> list[torch.Tensor]:
    return [t[:upto].clone() for pair in policy.context.key_value_memory_dict.values()
            for t in pair]


def test_rollback_leaves_the_cache_of_plain_decoding(model: GPTModel) -> None:
    prompt, accepted, rejected = list(b"hello wor"), [108, 100], [7, 9, 11]
    rows = [DecodeRow(prompt, RowSampling.make(SamplingParams(max_tokens=8), 0, 0))]
    device = torch.device("cpu")
    with torch.inference_mode(), InferenceMode.active():
        # Speculative: prefill, then one window of the accepted and rejected drafts.
        tokens, context, wrapper, full = open_batch(model, rows, device, slack=4)
        spec = CachedPolicy(model, context, wrapper)
        n = len(prompt)
        spec.forward(tokens[:, :n], full["position_ids"][:, :n])
        window = torch.tensor([[*accepted, *rejected]])
        spec.forward(window, full["position_ids"][:, n : n + window.shape[1]])
        spec.rollback(n + len(accepted))
        # Plain: the prompt and the accepted tokens only, one forward.
        _, context2, wrapper2, full2 = open_batch(model, rows, device, slack=4)
        plain = CachedPolicy(model, context2, wrapper2)
        known = torch.tensor([[*prompt, *accepted]])
        plain.forward(known, full2["position_ids"][:, : known.shape[1]])
        assert spec.offset == plain.offset == n + len(accepted)
        for a, b in zip(_cache(spec, spec.offset), _cache(plain, plain.offset), strict=True):
            assert (a - b).abs().max().item() < 1e-5
        for key, value in context.key_value_memory_dict.values():  # the drafts are forgotten
            assert not key[spec.offset : n + 5].any() and not value[spec.offset : n + 5].any()
        # And decoding goes on exactly as without speculation.
        nxt = torch.tensor([[42]])
        pos = full["position_ids"][:, spec.offset : spec.offset + 1]
        got = spec.forward(nxt, pos)[0][0, -1]
    want = full_logits(model, torch.cat([known, nxt], 1))[0, -1]
    assert (got - want).abs().max().item() < 1e-4


def test_ngram_lookup_and_metrics() -> None:
    drafter = NgramDrafter(ngram_max=3, ngram_min=2)
    assert drafter.lookup([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]  # latest match of (2, 3)
    assert drafter.lookup([5, 1, 2, 7, 1, 2, 8, 1, 2], 3) == [8, 1, 2]
    assert drafter.lookup([1, 2, 3], 2) == []
    assert drafter.lookup([4, 4, 4], 3) == [4]  # a repeating loop overlaps its own suffix
    stats = [Sample((1,), (2, 3), (0.0, 0.0), "length", 0)]
    assert speculation_metrics(stats) == {}
