"""Logits processors, exact: every option ``generate`` turns into a prefix-only processor, and a
caller's own processor that declares itself prefix-only, applied at every verified position
with that position's prefix — greedy output token for token equal to ``generate``'s at batch 1
and 3, with every proposer; sampled output follows generate's law under processors that reshape
it; processors that cannot be shown prefix-only go to the original ``generate`` by name."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
)

import autospec

from conftest import EOS, noisy_copy, prompt, tiny
from test_batch_exact import batch
from test_sampled_exact import V, empirical, exact_joint
from test_verify import ALPHA, _chi2_pvalue

POLICIES = ["fixed:3", "fixed:6", "ngram:4", "suffix:4", "auto"]


class NoEcho(LogitsProcessor):
    """A caller's processor that reads the prefix: never the token just emitted."""

    prefix_only = True

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -1:], float("-inf"))


class Undeclared(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


@pytest.fixture(scope="module")
def models():
    target = tiny("llama", layers=2, seed=0, sharpen=30.0)
    return target, noisy_copy(target, 0.5)


def _options(free: list[int]) -> dict:
    """Each served option, with tokens taken from the free-running output so that it changes
    the output (checked by the test)."""
    a, b, c, d, e = free[1], free[2], free[3], free[4], free[6]
    return {
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[a], [c, d]]),
        "sequence_bias": dict(sequence_bias={(b,): -30.0, (c, 11): 40.0}),
        "suppress_tokens": dict(suppress_tokens=[a, e]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[free[0]]),
        "forced_eos_token_id": dict(forced_eos_token_id=7),
        "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(3, 1.4),
                                                 eos_token_id=[EOS, d]),
        "custom": dict(logits_processor=LogitsProcessorList([NoEcho()])),
        "builtin instance": dict(logits_processor=LogitsProcessorList(
            [NoRepeatNGramLogitsProcessor(3)])),
        "several": dict(bad_words_ids=[[b]], no_repeat_ngram_size=3,
                        logits_processor=LogitsProcessorList([NoEcho()])),
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_under_every_processor_equals_generate_at_batch_1(models, policy):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=policy, suffix=True)
    for seed in range(2):
        ids = prompt(10, seed=seed)
        free = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
        free = free[0, ids.shape[1]:].tolist()
        for name, kw in _options(free).items():
            kw = dict(eos_token_id=None) | kw
            ref = target.generate(ids, max_new_tokens=24, do_sample=False, **kw)
            assert ref[0, ids.shape[1]:].tolist() != free, name  # the processor matters
            for _ in range(2):  # suffix decoding drafts from the first call's output
                out = spec.generate(ids, max_new_tokens=24, do_sample=False, **kw)
                assert torch.equal(out, ref), (policy, name, seed)
                assert spec.last_stats is not None, name  # served, not handed over
    assert not spec.fallbacks
    if policy != "auto":  # the proposer drafted under the processors
        assert sum(c.proposed for c in spec.last_stats.counts.values()) > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_under_processors_equals_batched_generate(models, policy):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=policy, suffix=True)
    ids, mask = batch([5, 11, 8], seed=3)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                           eos_token_id=None)
    for name, kw in _options(free[0, ids.shape[1]:].tolist()).items():
        kw = dict(eos_token_id=[EOS, 17]) | kw
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              **kw)
        for _ in range(2):
            out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                **kw)
            assert torch.equal(out, ref), (policy, name)
            assert len(spec.last_row_stats) == 3
    assert not spec.fallbacks


def test_prefix_allowed_tokens_fn_sees_each_rows_batch_index(models):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy="fixed:4")
    ids, mask = batch([6, 9, 4], seed=5)

    def allowed(batch_id: int, seq: torch.Tensor) -> list[int]:
        # row b may use tokens ≡ b (mod 3), and never the one it emitted last
        return [t for t in range(4, 97) if t % 3 == batch_id and t != int(seq[-1])]

    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
              prefix_allowed_tokens_fn=allowed)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, **kw)
    assert torch.equal(out, ref) and not spec.fallbacks
    assert all(int(t) % 3 == b for b in range(3) for t in out[b, ids.shape[1]:])


def test_scores_and_logits_under_processors_are_generates(models):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy="fixed:4")
    ids = prompt(9, seed=7)
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, no_repeat_ngram_size=2,
              bad_words_ids=[[5], [9, 10]], output_scores=True, output_logits=True,
              return_dict_in_generate=True)
    ref, out = target.generate(ids, **kw), spec.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    # a block's forward and generate's one-token forwards round apart (fp32): close, and the
    # processors' bans (−inf) in the same places
    for mine, theirs in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        assert torch.equal(mine.isinf(), theirs.isinf())
    for mine, theirs in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert (torch.stack(out.scores)[:, 0, 5] == float("-inf")).all()


def test_processors_not_known_to_be_prefix_only_go_to_generate_by_name(models):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy="fixed:4")
    ids = prompt(8, seed=2)
    out = spec.generate(ids, max_new_tokens=8, do_sample=False,
                        logits_processor=LogitsProcessorList([Undeclared()]))
    assert torch.equal(out, target.generate(ids, max_new_tokens=8, do_sample=False))
    assert spec.last_stats is None
    assert any("Undeclared" in r and "prefix_only = True" in r for r in spec.fallbacks)
    # an instance built for one batch (its function sees batch ids) serves batch 1 alone
    fixed = PrefixConstrainedLogitsProcessor(lambda b, s: [5, 6, 7], 1)
    ids3, mask = batch([4, 6, 5], seed=1)
    spec.generate(ids3, attention_mask=mask, max_new_tokens=4, do_sample=False,
                  logits_processor=LogitsProcessorList([fixed]))
    assert any("PrefixConstrainedLogitsProcessor" in r and "batch > 1" in r
               for r in spec.fallbacks)
    spec.generate(ids, max_new_tokens=4, do_sample=False,
                  logits_processor=LogitsProcessorList([fixed]))
    assert spec.last_stats is not None


# sampled: bad words ban (1, 4) — token 4 right after a 1, which a draft token 1 puts in the
# block (free, the likeliest pair) — and sequence bias lowers 6 everywhere and raises 1 after a 7
BIAS = {(6,): -2.0, (7, 1): 2.0}
SAMPLED = dict(top_k=0, bad_words_ids=[[1, 4]], sequence_bias=BIAS)


@pytest.mark.parametrize("k", [1, 3])
def test_sampling_under_processors_follows_generates_law(k):
    target = tiny("llama", vocab=V, sharpen=4.0, seed=3)
    draft = noisy_copy(target, 2.0, seed=4)
    spec = autospec.Controller(target, draft, store=False, policy=4)
    ids = prompt(6, seed=1, vocab=V)
    law = exact_joint(target, ids, **SAMPLED)
    assert law[1, 4] == 0 and law[:, 4].sum() > 0.05  # the ban reads the prefix
    counts, drafted, rejected = empirical(spec, ids, k, SAMPLED, seed=20 + k)
    assert not spec.fallbacks and drafted > 0 and rejected > 0
    assert counts[1 * V + 4] == 0
    assert _chi2_pvalue(counts, law.flatten()) > ALPHA
    for wrong in (dict(top_k=0, bad_words_ids=[[1, 4]]), dict(top_k=0, sequence_bias=BIAS)):
        assert _chi2_pvalue(counts, exact_joint(target, ids, **wrong).flatten()) < ALPHA, wrong


class BanAndWatch(LogitsProcessor):
    """Bans one token, and notes every call on a prefix that ends with it (a position after a
    forbidden proposal)."""

    prefix_only = True

    def __init__(self, token: int):
        self.token, self.after_ban = token, 0

    def __call__(self, input_ids, scores):
        self.after_ban += int((input_ids[:, -1] == self.token).sum())
        scores = scores.clone()
        scores[:, self.token] = float("-inf")
        return scores


@pytest.mark.parametrize("policy", ["ngram:4", "suffix:4"])
def test_a_lookups_block_ends_at_the_first_token_the_processors_forbid(models, policy):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=policy, suffix=True)
    a, b, c = 20, 21, 22
    ids = torch.tensor([[a, b, c] * 5 + [a, b]])  # prompt lookup proposes c, a, b, c, …
    for _ in range(2):  # suffix decoding drafts from the first call's output
        watch = BanAndWatch(c)
        kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None,
                  logits_processor=LogitsProcessorList([watch]))
        ref = target.generate(ids, **kw)
        assert watch.after_ban == 0  # generate never emits it
        out = spec.generate(ids, **kw)
        assert torch.equal(out, ref)
    assert watch.after_ban == 0  # nor is a position after a proposed c ever scored
    assert spec.last_stats.counts[policy.split(":")[0]].proposed > 0


def test_sampled_rows_under_processors_follow_their_laws_at_batch_3():
    # rows of different prompts, each against its own law under the processors (bad words and
    # sequence bias read only the tokens just before a position: left padding changes nothing)
    target = tiny("llama", vocab=V, sharpen=4.0, seed=3)
    draft = noisy_copy(target, 2.0, seed=4)
    spec = autospec.Controller(target, draft, store=False, k_max=8)
    lengths = [6, 4, 5]
    ids, mask = batch(lengths, seed=11, vocab=V)
    L = ids.shape[1]
    laws = [exact_joint(target, ids[b : b + 1, L - n :], **SAMPLED).flatten()
            for b, n in enumerate(lengths)]
    g = torch.Generator().manual_seed(9)
    counts = torch.zeros(3, V * V, dtype=torch.long)
    for _ in range(2000):
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True,
                            eos_token_id=None, k=3, generator=g, pad_token_id=0, **SAMPLED)
        for b in range(3):
            counts[b, out[b, L] * V + out[b, L + 1]] += 1
    assert not spec.fallbacks
    for b in range(3):
        assert counts[b, 1 * V + 4] == 0
        assert _chi2_pvalue(counts[b], laws[b]) > ALPHA, b
    st = spec.last_stats
    assert 0 < st.accepted < st.drafted
