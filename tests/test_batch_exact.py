"""Batched generate is exact: every row equals the target's own batched greedy ``generate`` on
the same left-padded batch, token for token (fp32), whatever each row accepts; sampled rows
follow the target's distribution; every row is its own request in the store."""

from __future__ import annotations

import random

import pytest
import torch

import autospec
import autospec.engine.slots
from autospec.policies import Context

from conftest import EOS, noisy_copy, tiny, tiny_tokenizer
from test_sampled_exact import V, exact_joint
from test_verify import ALPHA, _chi2_pvalue


def batch(lengths, seed=0, vocab=97, pad=0):
    """Left-padded prompts of the given lengths: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.full((len(lengths), L), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, L - n :] = torch.randint(4, vocab, (n,), generator=g)
        mask[i, L - n :] = 1
    return ids, mask


def reference(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, **kw)


@pytest.mark.parametrize("k", range(1, 7))
def test_every_row_equals_batched_generate_for_every_k(pair, k):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False)
    for seed in range(2):
        ids, mask = batch([5, 11, 8, 3], seed=seed)
        ref = reference(target, ids, mask, max_new_tokens=24, eos_token_id=[EOS, 17, 40])
        out = spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                            eos_token_id=[EOS, 17, 40], k=k)
        assert torch.equal(out, ref), (k, seed)
    assert not spec.fallbacks
    stats = spec.last_row_stats
    assert len(stats) == 4 and all(st.batch_size == 4 for st in stats)
    assert spec.last_stats.drafted > 0


def test_k_changing_every_iteration_stays_exact(pair):
    target, draft = pair
    rng = random.Random(0)
    seen_ks = []

    def policy(ctx: Context) -> int:
        k = rng.randint(0, 6)
        seen_ks.append((ctx.batch_size, k))
        return k

    spec = autospec.Controller(target, draft, store=False, policy=policy)
    for seed in range(3):
        ids, mask = batch([4, 9, 6], seed=10 + seed)
        ref = reference(target, ids, mask, max_new_tokens=30, eos_token_id=None)
        out = spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                            eos_token_id=None)
        assert torch.equal(out, ref), seed
    assert {k for _, k in seen_ks} >= {0, 1, 6}
    # rows reach max_new_tokens at different iterations (they accept different counts)
    assert seen_ks[0][0] == 3 and {b for b, _ in seen_ks} <= {1, 2, 3}


def _eos_case(target, ids, mask, rows):
    """EOS ids taken from the middle of some rows' free-running outputs, each a token that
    did not occur earlier in that row, so rows stop at different points."""
    free = reference(target, ids, mask, max_new_tokens=40, eos_token_id=None)[:, ids.shape[1]:]
    eos = []
    for r, start in rows:
        cands = [i for i in range(start, 35) if int(free[r, i]) not in free[r, :i].tolist()
                 and all(int(free[o, j]) != int(free[r, i]) for o, _ in rows if o != r
                         for j in range(0, 3))]
        if cands:
            eos.append(int(free[r, cands[0]]))
    return eos


def test_eos_in_different_rows_inside_accepted_blocks(arch):
    # a draft close to the target accepts long blocks, so EOS lands inside them
    target = tiny(arch, sharpen=30.0)
    draft = noisy_copy(target, 0.05)
    spec = autospec.Controller(target, draft, store=False)
    inside = 0
    stop_points = set()
    for seed in range(4):
        ids, mask = batch([6, 10, 8, 12], seed=20 + seed)
        eos = _eos_case(target, ids, mask, [(0, 4), (2, 13), (3, 22)])
        ref = reference(target, ids, mask, max_new_tokens=40, eos_token_id=eos or None)
        out = spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                            eos_token_id=eos or None, k=6)
        assert torch.equal(out, ref), seed
        for st in spec.last_row_stats:
            if st.stop_reason == "eos":
                stop_points.add(st.iterations)
                # the EOS was an accepted draft token (not only the block's last token)
                last_k, last_m = st.k_schedule[-1], st.accepted_schedule[-1]
                emitted_last = st.new_tokens - sum(m + 1 for m in st.accepted_schedule[:-1])
                inside += last_k > 0 and emitted_last <= last_m
    assert inside > 0
    assert len(stop_points) > 1  # rows stopped at different iterations


def test_finished_rows_leave_the_batch(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False)
    ids, mask = batch([6, 10, 8, 12], seed=3)
    eos = _eos_case(target, ids, mask, [(0, 2), (1, 6)])
    assert eos
    ref = reference(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    out = spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                        eos_token_id=eos, k=3)
    assert torch.equal(out, ref)
    longest = max(spec.last_row_stats, key=lambda st: st.new_tokens)
    batches = {b for b, _ in longest.target_s_by_bn}
    assert min(batches) < 4  # the long row ran on after the others left


def test_repacking_the_cache_keeps_every_row_exact(arch, monkeypatch):
    # holes pile up where rows accept different counts (a draft that often agrees); with no
    # slack they are squeezed out whenever they pass a quarter of the cache
    target = tiny(arch, sharpen=30.0)
    draft = noisy_copy(target, 0.2)
    ids, mask = batch([5, 13, 9], seed=5)
    ref = reference(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    spec = autospec.Controller(target, draft, store=False)
    monkeypatch.setattr(autospec.engine.slots, "SLACK", 10_000)
    loose = spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                          eos_token_id=None, k=5)
    loose_peak = spec.last_stats.peak_kv_bytes
    assert spec.last_stats.cache_repacks == 0
    monkeypatch.setattr(autospec.engine.slots, "SLACK", 0)
    tight = spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                          eos_token_id=None, k=5)
    assert torch.equal(loose, ref) and torch.equal(tight, ref)
    assert spec.last_stats.cache_repacks > 0
    assert spec.last_stats.peak_kv_bytes <= loose_peak


def test_min_new_tokens_and_max_length_as_generate(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False)
    ids, mask = batch([4, 9, 6], seed=7)
    eos = _eos_case(target, ids, mask, [(0, 1), (1, 2), (2, 1)])
    for kw in (dict(min_new_tokens=12, max_new_tokens=20), dict(max_length=ids.shape[1] + 15)):
        ref = reference(target, ids, mask, eos_token_id=eos, **kw)
        out = spec.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=eos, k=4,
                            **kw)
        assert torch.equal(out, ref), kw


def test_stop_strings_per_row(pair):
    target, draft = pair
    tok = tiny_tokenizer()
    spec = autospec.Controller(target, draft, store=False, tokenizer=tok)
    ids, mask = batch([4, 9, 6], seed=8)
    free = reference(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    word = tok.decode(free[1, ids.shape[1] + 7 : ids.shape[1] + 8])
    ref = reference(target, ids, mask, max_new_tokens=30, eos_token_id=None, stop_strings=word,
                    tokenizer=tok)
    out = spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                        eos_token_id=None, stop_strings=word, k=3)
    assert torch.equal(out, ref)
    assert "stopping_criteria" in {st.stop_reason for st in spec.last_row_stats}


def test_scores_and_logits_have_generates_layout(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False)
    ids, mask = batch([5, 8, 3], seed=9)
    eos = _eos_case(target, ids, mask, [(0, 3)])
    kw = dict(max_new_tokens=16, eos_token_id=eos, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    ref = reference(target, ids, mask, **kw)
    out = spec.generate(ids, attention_mask=mask, do_sample=False, k=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) and len(out.logits) == len(ref.logits)
    L = ids.shape[1]
    for t, (s, r, lo, rl) in enumerate(zip(out.scores, ref.scores, out.logits, ref.logits)):
        assert s.shape == r.shape and lo.shape == rl.shape
        for b in range(ids.shape[0]):
            live = t == 0 or int(ref.sequences[b, L + t - 1]) not in eos
            live = live and not any(int(x) in eos for x in ref.sequences[b, L : L + t])
            if live:  # finished rows hold throwaway values in generate
                torch.testing.assert_close(lo[b], rl[b], atol=1e-4, rtol=1e-4)


def test_category_list_must_match_the_batch(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False)
    ids, mask = batch([4, 6], seed=1)
    with pytest.raises(ValueError, match="2 names for a batch of 2|3 names for a batch of 2"):
        spec.generate(ids, attention_mask=mask, max_new_tokens=4, category=["a", "b", "c"])


def test_right_padding_goes_to_generate_as_it_warns(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False)
    ids, mask = batch([4, 6], seed=1)
    ids, mask = ids.flip(1), mask.flip(1)  # right padding
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, reference(target, ids, mask, max_new_tokens=5))
    assert any("right padding" in r for r in spec.fallbacks)
    wrong = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(Exception):  # noqa: B017 - whatever generate raises, we raise
        spec.generate(ids, attention_mask=wrong, max_new_tokens=5)


def test_every_row_is_a_request_with_its_category_and_batch_size(pair, tmp_path):
    from autospec.store import open_store, queries

    target, draft = pair
    url = f"sqlite:///{tmp_path / 'b.db'}"
    spec = autospec.Controller(target, draft, store=url)
    ids, mask = batch([4, 9, 6], seed=2)
    spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                  category=["code", "chat", "code"], k=2)
    spec.close()
    store = open_store(url)
    with store.session() as s:
        rows = queries.recent_requests(s, limit=10)
    store.close()
    assert sorted(r.category for r in rows) == ["chat", "code", "code"]
    assert all(r.batch_size == 3 for r in rows)


def test_pipeline_with_batch_size_runs_speculatively(pair):
    from transformers import pipeline

    target, draft = pair
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    texts = ["w5 w6 w7", "w8 w9 w10 w11 w12", "w13 w14", "w20 w21 w22 w23"]
    plain = pipeline("text-generation", model=target, tokenizer=tok)
    ref = plain(texts, batch_size=4, max_new_tokens=8, do_sample=False)
    spec = autospec.wrap(target, draft, store=False, tokenizer=tok)
    try:
        out = plain(texts, batch_size=4, max_new_tokens=8, do_sample=False)
    finally:
        autospec.unwrap(target)
    assert out == ref
    assert spec.last_stats is not None and spec.last_stats.batch_size == 4


def test_sampled_rows_follow_the_target_joint_distribution():
    # rows of different prompts in one batch, each against its own exact joint law
    target = tiny("llama", vocab=V, sharpen=25.0, seed=3)
    draft = noisy_copy(target, 1.0, seed=4)
    spec = autospec.Controller(target, draft, store=False, k_max=8)
    ids, mask = batch([6, 4, 5], seed=11, vocab=V)
    L = ids.shape[1]
    joints = [exact_joint(target, ids[b : b + 1, L - n :], top_k=0).flatten()
              for b, n in enumerate([6, 4, 5])]
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(3, V * V, dtype=torch.long)
    runs = 2500
    for _ in range(runs):
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True,
                            top_k=0, eos_token_id=None, k=2, generator=g)
        for b in range(3):
            counts[b, out[b, L] * V + out[b, L + 1]] += 1
    for b in range(3):
        assert _chi2_pvalue(counts[b], joints[b]) > ALPHA, b
    st = spec.last_stats
    assert 0 < st.accepted < st.drafted  # the draft disagrees: rejections are exercised


def test_each_rows_length_and_whether_it_stopped_at_its_cap_feed_its_category(pair):
    """What the cost model reads a row's tokens left by (``LiveStats.expected_left``): every
    row's new tokens, per category, with whether its ``max_new_tokens`` stopped it."""
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False)
    reasons = set()
    for seed in (2, 6):
        ids, mask = batch([5, 11, 8, 3], seed=seed)
        spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                      eos_token_id=[EOS, 17, 40], category=["a", "a", "b", "b"])
        rows = spec.last_row_stats
        for cat, (i, j) in (("a", (0, 1)), ("b", (2, 3))):
            assert list(spec.live_stats(cat).lengths)[-2:] == [
                (rows[r].new_tokens, rows[r].stop_reason == "max_new_tokens") for r in (i, j)]
        reasons |= {st.stop_reason for st in rows}
    assert reasons == {"eos", "max_new_tokens"}  # both kinds seen
