"""The n-gram (prompt-lookup) proposer: its index, exactness (greedy token identity against
``generate``; sampled output against the target's law, with a proposer that proposes tokens
the target finds unlikely), no draft model needed, the policy contract's proposer, and that
the draft model's statistics stay the draft model's. Tiny random-weight models, fp32."""

from __future__ import annotations

import pytest
import torch

import autospec
from autospec.costs.table import CostTable
from autospec.ngram import MATCH_REACH, OCCURRENCES, NgramIndex
from autospec.policies import Choice, Context, CostModelPolicy, LiveStats, as_policy

from conftest import noisy_copy, tiny
from test_sampled_exact import V, exact_joint
from test_verify import ALPHA, _chi2_pvalue


# -- the index ------------------------------------------------------------------------------
def test_the_latest_earlier_occurrence_of_the_longest_suffix_is_proposed():
    ix = NgramIndex([1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3], max_n=3, min_n=1)
    # suffix (9, 2, 3)? no; (2, 3) last occurred ending at 7 (before the suffix itself)
    assert ix.match() == (2, 7)
    assert ix.propose(3) == ([4, 5, 2], 2)
    ix.extend([4])  # suffix (2, 3, 4) occurred ending at 8
    assert ix.match() == (3, 8) and ix.propose(2) == ([5, 2], 3)
    # a suffix that never occurred before: shorter n, then nothing
    assert NgramIndex([7, 8, 9]).propose(4) == ([], 0)
    assert NgramIndex([7, 8, 7], max_n=2, min_n=2).propose(4) == ([], 0)  # 1-gram not allowed
    assert NgramIndex([7, 8, 7], max_n=2, min_n=1).propose(4) == ([8, 7, 8, 7], 1)


def test_a_matchs_length_is_how_far_the_context_agrees_with_the_source():
    """Past max_n: a copy in progress reads as a long match, a chance hit as a short one."""
    quote = [10, 11, 12, 13, 14, 15, 16]
    ix = NgramIndex(quote + [0] + quote[:5], max_n=3, min_n=1)
    assert ix.match() == (5, 5) and ix.propose(2) == ([15, 16], 5)
    ix.extend([15])
    assert ix.match() == (6, 6)
    chance = NgramIndex([1, 12, 13, 14, 15, 2, 3, 13, 14], max_n=3, min_n=1)
    assert chance.match() == (2, 4)  # (13, 14) occurred, preceded by 12 here and 3 there
    # the source is the occurrence that agrees furthest back, not the latest: a line copied
    # once beats a phrase repeated since
    ix = NgramIndex([5, 6, 7, 8, 1, 9, 7, 8, 2, 9, 7, 8, 3, 0, 5, 6, 7, 8], max_n=2, min_n=1)
    assert ix.match() == (4, 4) and ix.propose(1) == ([1], 4)
    long = list(range(100, 140))
    ix = NgramIndex(long + [0] + long, max_n=3, min_n=1)
    assert ix.match() == (MATCH_REACH, len(long))  # capped: the walk back stays short


def test_a_repeating_pattern_keeps_proposing_its_period():
    assert NgramIndex([5, 6, 5, 6]).propose(5) == ([5, 6, 5, 6, 5], 2)
    assert NgramIndex([4, 4]).propose(3) == ([4, 4, 4], 1)


def _back(hist, end, n):
    """How far hist's suffix and the tokens before ``end`` agree (≥ n, ≤ MATCH_REACH)."""
    length = n
    while (length < MATCH_REACH and end - 1 - length >= 0
           and hist[end - 1 - length] == hist[len(hist) - 1 - length]):
        length += 1
    return length


def _scan(hist, cursor, max_n, min_n):
    """``NgramIndex.match`` by its definition: the latest OCCURRENCES occurrences of the
    longest suffix n-gram that occurred, the one agreeing furthest back; ties to the first at
    or after the copy cursor, else the latest."""
    for n in range(min(max_n, len(hist)), min_n - 1, -1):
        suffix = hist[len(hist) - n :]
        ends = [e for e in range(n, len(hist)) if hist[e - n : e] == suffix]
        if ends:
            end = max(ends[-OCCURRENCES:], key=lambda e, n=n: (
                _back(hist, e, n), (1, -e) if cursor is not None and e >= cursor else (0, e)))
            return _back(hist, end, n), end
    return 0, -1


@pytest.mark.parametrize("prompt", [0, 37])
def test_the_index_equals_a_scan_after_every_token(prompt):
    """Against the definition, by brute force, over a long random history with repeats: the
    copy cursor moves past each generated token its match predicted (never over the tokens
    the index was built from), and a truncated index is the one built again."""
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 6, (400,), generator=g).tolist()
    ix = NgramIndex(toks[:prompt], max_n=4, min_n=2)
    cursor, moved = None, 0
    for i in range(prompt, len(toks)):
        before = _scan(toks[:i], cursor, 4, 2)
        if before[0] and toks[before[1]] == toks[i]:
            cursor, moved = before[1] + 1, moved + 1
        ix.extend([toks[i]])
        assert ix.match() == _scan(toks[: i + 1], cursor, 4, 2), i
    assert moved > 50  # the cursor decided ties, not just existed
    again = NgramIndex(toks[:prompt], max_n=4, min_n=2)
    again.extend(toks[prompt:120])
    ix.truncate(120)
    assert len(ix) == 120 and ix.match() == again.match() and ix._cursor == again._cursor


def test_at_a_tie_the_source_is_where_the_last_copy_left_off():
    """A summary quotes its passage in order: after copying from the passage, a chance hit
    of one token proposes what follows the next occurrence in the passage, not the latest
    occurrence (here the model's own quotation)."""
    passage = [1, 50, 51, 52, 9, 2, 60, 61, 62, 9, 3, 70, 71]
    prompt = passage + [9, 80, 81, 9]  # the instruction repeats the common token 9
    ix = NgramIndex(prompt, max_n=3, min_n=1)
    assert ix.match() == (1, 14)  # built from a prompt: no cursor, the latest of three ties
    ix.extend([50, 51, 52, 8])  # the model quotes the first sentence and closes the quote
    assert ix._cursor == 4  # 51 and 52 were predicted from the passage; 8 was not
    ix.extend([9])  # a chance hit among four occurrences of 9
    assert ix.match() == (1, 5) and ix.propose(3) == ([2, 60, 61], 1)
    ix.extend([2, 60])
    assert ix._cursor == 7
    # without the cursor (an index built over the same tokens) the latest 9 is the source:
    # the model's own quotation again
    assert NgramIndex(prompt + [50, 51, 52, 8, 9], max_n=3, min_n=1).propose(3) == (
        [50, 51, 52], 1)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(max_n=1, min_n=2)
    with pytest.raises(ValueError, match="max_n and min_n"):
        autospec.Controller(tiny(), None, store=False, ngram={"size": 3})


# -- policies -------------------------------------------------------------------------------
def test_policy_specs_name_the_proposer_and_an_int_still_means_the_draft_model():
    assert as_policy(3).choose(Context()) == 3 and not isinstance(as_policy(3).choose(
        Context()), Choice)
    c = as_policy("ngram:4").choose(Context(k_max=16))
    assert isinstance(c, Choice) and int(c) == 4 and c.proposer == "ngram"
    c = as_policy("hybrid:3:1").choose(Context(k_max=2))
    assert (int(c), c.proposer, c.min_match) == (2, "hybrid", 1)
    assert as_policy("hybrid:3").name == "hybrid:3:2"
    c = as_policy("ngram:3:2").choose(Context(k_max=16))  # a lookup's shortest match
    assert (int(c), c.proposer, c.min_match, c.fallback) == (3, "ngram", 2, False)
    for bad in ("ngram:x", "hybrid:3:0"):
        with pytest.raises(ValueError, match="bad policy|min_match"):
            as_policy(bad)
    with pytest.raises(ValueError, match="proposer"):
        Choice(2, "")


def test_cost_model_drafts_by_n_gram_only_where_it_has_a_match():
    live, costs = LiveStats(discount=1.0), CostTable().at("eager")
    for _ in range(3):
        live.observe(0, 0, 0.0, 0.1)  # T_t(1), settled
        costs.observe(0, 0.1)
    for _ in range(50):
        live.observe_lookup("ngram", 4, 3, 1e-5, 0.1)
        costs.observe(4, 0.1, lookups={"ngram": 1e-5 / 4})
    pol = CostModelPolicy()
    without_draft = Context(k_max=8, live=live, costs=costs, proposers=("ngram",),
                            matches={"ngram": (2,)})
    c = pol.choose(without_draft)
    assert isinstance(c, Choice) and c.proposer == "ngram" and int(c) > 0
    no_match = Context(k_max=8, live=live, costs=costs, proposers=("ngram",),
                       matches={"ngram": (0,)})
    assert int(pol.choose(no_match)) == 0
    # n-gram counts (and time) are not the draft model's
    assert live.counts("draft")[1][0] == 0 and live.counts("ngram")[1][0] == 50
    assert costs.t_draft is None


# -- exactness, greedy ----------------------------------------------------------------------
def _repetitive(seed: int, length: int = 10) -> torch.Tensor:
    """A prompt that repeats itself, so the n-gram proposer finds matches."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(4, 90, (1, length), generator=g)
    return torch.cat([base, base[:, : length // 2], base], dim=1)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    target = tiny(request.param, layers=2, seed=5)
    return target, noisy_copy(target, 0.1)


@pytest.mark.parametrize("policy", ["ngram:1", "ngram:3", "ngram:6", "hybrid:4:1",
                                    "hybrid:2:3", "auto"])
def test_greedy_output_is_generates_token_for_token(pair, policy):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False, policy=policy)
    drafted = accepted = 0
    for seed in range(3):
        ids = _repetitive(seed)
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                              do_sample=False)
        out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                            do_sample=False)
        assert torch.equal(out, ref), (policy, seed)
        drafted += spec.last_stats.proposer("ngram").proposed
        accepted += spec.last_stats.proposer("ngram").accepted
    assert 0 < accepted < drafted  # n-gram blocks ran, were accepted and rejected


def test_greedy_without_a_draft_model_stops_at_eos_inside_a_block(pair):
    target, _ = pair
    ids = _repetitive(7)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                          do_sample=False)
    new = ref[0, ids.shape[1]:].tolist()
    # an EOS id the target emits late: with n-gram blocks of 6 it lands inside one
    eos = new[25]
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                          do_sample=False, eos_token_id=eos, pad_token_id=0)
    spec = autospec.Controller(target, None, store=False, policy="ngram:6")
    out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                        do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref) and out[0, -1].item() == eos
    assert spec.last_stats.stop_reason == "eos" and spec.last_stats.proposer("ngram").proposed > 0


# -- exactness, sampled ---------------------------------------------------------------------
class _Unlikely:
    """A deterministic proposer for the test: always proposes [the target's least likely
    first token, the most likely one] — so both the acceptance path and the residual path
    (p with the proposal removed) carry real mass."""

    def __init__(self, tokens, proposal):
        self.proposal = list(proposal)

    def extend(self, tokens):
        return None

    def match(self):
        return 2, 0

    def propose(self, k):
        return self.proposal[:k], 2


@pytest.mark.parametrize("kwargs", [dict(top_k=0), dict(temperature=0.7, top_k=6)])
def test_sampled_first_two_tokens_follow_the_targets_law(kwargs):
    target = tiny("llama", vocab=V, sharpen=4.0, seed=3)
    ids = torch.randint(4, V, (1, 6), generator=torch.Generator().manual_seed(1))
    law = exact_joint(target, ids, **kwargs)  # [V, V]
    first = law.sum(1)
    unlikely, likely = int(first.argmin()), int(first.argmax())
    assert first[unlikely] < 0.05  # the proposal the target finds unlikely

    def factory(tokens):
        return _Unlikely(tokens, [unlikely, likely])

    spec = autospec.Controller(target, None, store=False, policy="ngram:2", ngram=factory)
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(V * V, dtype=torch.long)
    drafted = accepted = 0
    for _ in range(2000):
        out = spec.generate(ids, max_new_tokens=2, do_sample=True, generator=g,
                            eos_token_id=None, **kwargs)
        counts[out[0, 6] * V + out[0, 7]] += 1
        drafted += spec.last_stats.proposer("ngram").proposed
        accepted += spec.last_stats.proposer("ngram").accepted
    assert _chi2_pvalue(counts, law.flatten()) > ALPHA
    assert drafted >= 2000 and accepted < 0.2 * drafted  # the unlikely token was rejected
    # power: the law of emitting the proposal whenever proposed is rejected
    wrong = torch.zeros(V, V)
    wrong[unlikely, likely] = 1.0
    assert _chi2_pvalue(counts, (0.5 * law + 0.5 * wrong).flatten()) < ALPHA


# -- no draft model -------------------------------------------------------------------------
def test_wrap_without_a_draft_model_serves_and_logs(tmp_path):
    target = tiny("llama", layers=1, seed=9)
    url = f"sqlite:///{tmp_path / 'nd.db'}"
    autospec.wrap(target, store=url)
    try:
        ids = _repetitive(3)
        ref_out = target._autospec_controller._original_generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False, category="copy")
        assert torch.equal(out, ref_out)
        stats = target._autospec_controller.last_stats
        assert stats.proposer("ngram").blocks > 0 and stats.drafts == 0
        batch = torch.cat([ids, ids], dim=0)  # batch > 1 runs through the batched loop
        ref = target._autospec_controller._original_generate(
            batch, attention_mask=torch.ones_like(batch), max_new_tokens=8, do_sample=False)
        out = target.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=8,
                              do_sample=False, category="copy")
        assert torch.equal(out, ref) and not target._autospec_controller.fallbacks
    finally:
        autospec.unwrap(target)
    from autospec.store import open_store, queries

    with open_store(url) as store, store.session() as s:
        (pair,) = queries.pairs(s)
        (sm,) = queries.category_summaries(s)
    assert pair.draft == "none (n-gram)" and sm.category == "copy" and sm.requests == 3


# -- batch > 1 ------------------------------------------------------------------------------
def _repetitive_batch(lengths, seed=0, pad=0):
    """Left-padded rows that repeat themselves (different lengths, different periods)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        base = torch.randint(4, 90, (n,), generator=g)
        rows.append(torch.cat([base, base[: n // 2], base]))
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = r
        mask[i, L - len(r):] = 1
    return ids, mask


@pytest.mark.parametrize("policy, draft_model", [
    (p, d) for p in ("ngram:2", "ngram:5", "hybrid:4:1", "hybrid:3:3", "auto")
    for d in (True, False) if d or not p.startswith("hybrid")],  # the hybrid needs the draft
    ids=lambda x: x if isinstance(x, str) else "with-draft" if x else "no-draft")
def test_batched_greedy_rows_are_generates_with_the_n_gram_proposer(pair, policy, draft_model):
    target, draft = pair
    spec = autospec.Controller(target, draft if draft_model else None, store=False,
                               policy=policy)
    drafted = accepted = short = 0
    for seed in range(2):
        ids, mask = _repetitive_batch([6, 9, 4], seed=seed)
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                              eos_token_id=[3, 41], pad_token_id=0)
        out = spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                            eos_token_id=[3, 41], pad_token_id=0)
        assert torch.equal(out, ref), (policy, seed)
        assert not spec.fallbacks
        for st in spec.last_row_stats:
            drafted += st.proposer("ngram").proposed
            accepted += st.proposer("ngram").accepted
            short += sum(1 for k, used in zip(st.k_schedule, st.proposer_schedule)
                         if used and k < 5)
    assert 0 < accepted <= drafted
    if policy != "auto":  # fixed blocks meet rejections; how long auto's are depends on timings
        assert accepted < drafted
    if policy == "ngram:5":  # rows proposed blocks shorter than the batch's k
        assert short > 0
    if policy.startswith("hybrid") and draft_model:
        assert spec.last_stats.drafted > 0  # rows without a long match took the draft model's


@pytest.mark.parametrize("kwargs", [dict(top_k=0)])
def test_batched_sampled_rows_follow_the_targets_law_with_short_blocks(kwargs):
    """Two rows with different prompts: row 0 always gets a 2-token block, row 1 a 1-token
    block (shorter than the batch's k = 2): per-row chi-square on the first two tokens."""
    target = tiny("llama", vocab=V, sharpen=4.0, seed=3)
    prompts = [torch.randint(4, V, (1, 6), generator=torch.Generator().manual_seed(s))
               for s in (1, 2)]
    laws = [exact_joint(target, p, **kwargs) for p in prompts]
    picks = []
    for law in laws:
        first = law.sum(1)
        picks.append([int(first.argmin()), int(first.argmax())])

    class Rows:
        def __init__(self, tokens):
            self.row = 0 if tokens[:6] == prompts[0][0].tolist() else 1

        def extend(self, tokens):
            return None

        def match(self):
            return 2, 0

        def propose(self, k):
            return picks[self.row][: k - self.row], 2

    spec = autospec.Controller(target, None, store=False, policy="ngram:2", ngram=Rows)
    ids = torch.cat(prompts, dim=0)
    g = torch.Generator().manual_seed(5)
    counts = [torch.zeros(V * V, dtype=torch.long) for _ in prompts]
    for _ in range(2000):
        # 3 new tokens, so that k = 2 fits; the first two are counted
        out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                            do_sample=True, generator=g, eos_token_id=None, **kwargs)
        for b in range(2):
            counts[b][out[b, 6] * V + out[b, 7]] += 1
        sts = spec.last_row_stats
        assert [st.k_schedule[0] for st in sts] == [2, 1]
    for b in range(2):
        assert _chi2_pvalue(counts[b], laws[b].flatten()) > ALPHA, b
        assert _chi2_pvalue(counts[b], laws[1 - b].flatten()) < ALPHA, b  # rows not mixed


def test_on_a_device_the_prompt_comes_back_with_the_first_sync(pair, monkeypatch):
    """Where the prompt is not in host memory (a GPU) the index is built from the first
    iteration's host sync, not from a read of its own: no extra read, same output, and the
    n-gram proposes from the second iteration on."""
    import autospec.engine.batch as loop_mod

    target, draft = pair
    monkeypatch.setattr(loop_mod, "host_tokens", lambda ids: None)
    reads = []
    original = torch.Tensor.tolist

    def counted(self, *a, **kw):
        reads.append(1)
        return original(self, *a, **kw)

    spec = autospec.Controller(target, draft, store=False, policy="ngram:4")
    ids = _repetitive(2)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                          do_sample=False)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                        do_sample=False)
    monkeypatch.setattr(torch.Tensor, "tolist", original)
    st = spec.last_stats
    assert torch.equal(out, ref)
    assert st.proposer_schedule[0] is None and st.proposer("ngram").blocks > 0
    assert len(reads) <= st.iterations + 1  # one per iteration (+ the output's)
