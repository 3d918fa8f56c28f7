"""Suffix decoding (``autospec.suffix``, the "suffix" proposer): what the index proposes, the
bounds on its memory, and that serving with it keeps the target's output exactly — greedy
token for token at batch 1 and 3, sampled by a chi-square on the first two tokens."""

from __future__ import annotations

import pytest
import torch

import autospec
from autospec.suffix import OCCURRENCES, SuffixIndex, SuffixMemory, SuffixSettings

from conftest import tiny
from test_sampled_exact import V, exact_joint
from test_verify import ALPHA, _chi2_pvalue


# -- the index ------------------------------------------------------------------------------
def test_the_continuation_most_matched_places_agree_on_is_proposed():
    idx = SuffixIndex()
    # "1 2 3" is followed by 4 5 twice and by 4 6 once: the walk takes 4, then 5
    idx.add([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 9, 1, 2, 3, 4, 5, 9])
    toks, match = idx.propose([8, 1, 2, 3], 3)
    assert match == 3 and toks == [4, 5, 9]
    # another sequence makes 4 6 the more frequent branch
    for _ in range(3):
        idx.add([1, 2, 3, 4, 6, 7])
    assert idx.propose([8, 1, 2, 3], 3)[0] == [4, 6, 7]


def test_a_block_is_at_most_the_spec_factor_times_the_match_and_stops_at_low_probability():
    idx = SuffixIndex(SuffixSettings(max_spec_factor=1.0, min_token_prob=0.0))
    idx.add([5, 6, 7, 8, 9, 10, 11])
    assert idx.propose([6], 8) == ([7], 1)  # a 1-token match earns 1 token
    assert idx.propose([5, 6], 8) == ([7, 8], 2)
    wide = SuffixIndex(SuffixSettings(max_spec_factor=3.0, min_token_prob=0.0))
    wide.add([5, 6, 7, 8, 9, 10, 11])
    assert wide.propose([5, 6], 8) == ([7, 8, 9, 10, 11], 2)  # up to 6, the text ends at 5
    # four places continue four ways: each way has probability 1/4
    spread = [1, 2, 10, 1, 2, 11, 1, 2, 12, 1, 2, 13]
    picky, lax = (SuffixIndex(SuffixSettings(min_token_prob=p)) for p in (0.3, 0.2))
    picky.add(spread)
    lax.add(spread)
    assert picky.propose([1, 2], 4) == ([], 0)  # a match, but no token likely enough
    assert lax.propose([1, 2], 1)[0] in ([10], [11], [12], [13])


def test_the_current_suffix_never_matches_itself():
    idx = SuffixIndex()
    idx.add([4, 5, 6])
    assert idx.propose([4, 5, 6], 4) == ([], 0)  # 5 6 was never followed by anything
    idx.extend(0, [4, 5])
    assert idx.propose([4, 5, 6, 4, 5], 4)[0] == [6, 4]  # 2 tokens matched: 2 proposed


def test_a_short_match_proposes_nothing_below_min_match():
    idx = SuffixIndex(SuffixSettings(min_match=3))
    idx.add([1, 2, 3, 4, 1, 2, 9, 4])
    assert idx.propose([7, 2, 3], 2) == ([], 0)  # 2 tokens match
    assert idx.propose([1, 2, 3], 2) == ([4, 1], 3)


def test_dropping_the_oldest_sequence_forgets_its_places():
    idx = SuffixIndex()
    idx.add([1, 2, 3])
    idx.add([1, 2, 4])
    assert idx.propose([1, 2], 1)[0] in ([3], [4])
    idx.drop_oldest()
    assert idx.propose([1, 2], 1) == ([4], 2) and idx.tokens == 3
    idx.drop_oldest()
    assert idx.propose([1, 2], 1) == ([], 0) and idx.tokens == 0
    assert not any(idx._places.values())


def test_places_per_seed_are_bounded():
    idx = SuffixIndex()
    idx.add([1, 2] * 500)
    assert max(len(v) for places in idx._places.values() for v in places.values()) <= OCCURRENCES


def test_memory_is_per_category_and_bounded_by_requests_and_tokens():
    mem = SuffixMemory(SuffixSettings(max_requests=5, max_tokens=60, max_depth=4))
    for i in range(1000):
        mem.remember("sql", [0, 0, 0, 7], [10 + i % 50, 20, 30, 40, 50])
        mem.remember("json", [7], [60, 61])
        held = mem.categories()
        assert held["sql"][0] <= 5 and held["sql"][1] <= 60
        assert held["json"][0] <= 5
    assert mem.evicted > 0
    # the latest outputs are what is kept, and categories do not share text
    assert mem.propose("sql", [7, 10 + 999 % 50], 3) == ([20, 30], 2)  # 2 × a 2-token match
    assert mem.propose("json", [7, 10 + 999 % 50], 3) == ([], 0)
    assert mem.propose("chat", [7], 3) == ([], 0)


@pytest.mark.parametrize("bad", [dict(max_depth=0), dict(max_spec_factor=0),
                                 dict(min_token_prob=1.5), dict(max_requests=True),
                                 dict(min_match=30, max_depth=24)])
def test_bad_settings_are_refused_with_the_field_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SuffixSettings(**bad)
    with pytest.raises(ValueError, match="suffix= takes"):
        SuffixSettings.of({"depth": 3})


# -- serving --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny("llama", layers=2, seed=5)


def _requests(n: int, seed: int = 0):
    """Prompts that share a long head (one schema, one template) and differ at the end."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(4, 90, (1, 10), generator=g)
    return [torch.cat([head, torch.randint(4, 90, (1, 3), generator=g)], dim=1)
            for _ in range(n)]


@pytest.mark.parametrize("policy", ["suffix:1", "suffix:4", "suffix:8"])
@pytest.mark.parametrize("with_draft", [False, True], ids=["alone", "with-draft"])
def test_greedy_requests_in_order_are_generates_token_for_token(target, policy, with_draft):
    from conftest import noisy_copy

    draft = noisy_copy(target, 0.1) if with_draft else None
    spec = autospec.Controller(target, draft, store=False, policy=policy)
    drafted = accepted = 0
    for ids in _requests(4):
        mask = torch.ones_like(ids)
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                            category="sql")
        assert torch.equal(out, ref), policy
        st = spec.last_stats
        assert st.drafted == 0 and st.proposer("ngram").proposed == 0  # the suffix proposer alone
        drafted += st.proposer("suffix").proposed
        accepted += st.proposer("suffix").accepted
    assert 0 < accepted < drafted
    assert spec.suffix_memory.categories()["sql"][0] == 4


def test_a_repeated_request_is_proposed_from_the_earlier_output(target):
    """The second time a prompt comes, its whole output is in the category's memory: every
    block is 8 tokens accepted whole, 9 tokens per iteration."""
    spec = autospec.Controller(target, None, store=False, policy="suffix:8")
    ids = _requests(1, seed=3)[0]
    first = spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                          category="tools")
    cold = spec.last_stats
    second = spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                           category="tools")
    warm = spec.last_stats
    assert torch.equal(first, second)
    assert warm.proposer("suffix").accepted == warm.proposer("suffix").proposed >= 30
    assert warm.iterations == -(-40 // 9) < cold.iterations
    # another category has not seen it
    spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, category="chat")
    assert spec.last_stats.iterations > warm.iterations


def test_batched_greedy_rows_are_generates_with_the_suffix_proposer(target):
    spec = autospec.Controller(target, None, store=False, policy="suffix:4")
    reqs = _requests(6, seed=1)
    for ids in reqs[:3]:  # earlier requests of the category
        spec.generate(ids, max_new_tokens=20, do_sample=False, category="sql")
    lens = [13, 9, 11]
    L = max(lens)
    ids = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, L, dtype=torch.long)
    for b, (r, n) in enumerate(zip(reqs[3:], lens)):
        ids[b, L - n :] = r[0, -n:]
        mask[b, L - n :] = 1
    rows = batch_is_generates(spec, target, ids, mask)
    assert sum(st.proposer("suffix").proposed for st in rows) > sum(st.proposer("suffix").accepted for st in rows) > 0
    # rows proposed from their own matches: blocks of different lengths in one iteration
    assert any(len({st.k_schedule[i] for st in rows if i < len(st.k_schedule)}) > 1
               for i in range(5))


def batch_is_generates(spec, target, ids, mask, category: str = "sql"):
    """A batched greedy call of ``spec`` equals the target's own ``generate`` token for
    token, served without a fallback; returns its rows' stats."""
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=[3, 41],
              pad_token_id=0)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, category=category, **kw)
    assert torch.equal(out, ref)
    assert not spec.fallbacks
    return spec.last_row_stats


@pytest.mark.parametrize("kwargs", [dict(top_k=0), dict(temperature=0.7, top_k=6)])
def test_sampled_first_two_tokens_follow_the_targets_law(kwargs):
    """The category's memory holds [the target's least likely first token, its most likely
    one] after the prompt, so every call proposes them: acceptance and the residual law (p
    with the proposal removed) both carry mass. Chi-square against the exact joint law."""
    target = tiny("llama", vocab=V, sharpen=4.0, seed=3)
    ids = torch.randint(4, V, (1, 6), generator=torch.Generator().manual_seed(1))
    law = exact_joint(target, ids, **kwargs)
    first = law.sum(1)
    unlikely, likely = int(first.argmin()), int(first.argmax())
    assert first[unlikely] < 0.05
    spec = autospec.Controller(target, None, store=False, policy="suffix:2")
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(V * V, dtype=torch.long)
    drafted = accepted = 0
    for _ in range(2000):
        spec.suffix_memory = SuffixMemory()  # only the planted output, never the last call's
        spec.suffix_memory.remember("default", ids[0].tolist(), [unlikely, likely])
        out = spec.generate(ids, max_new_tokens=2, do_sample=True, generator=g,
                            eos_token_id=None, **kwargs)
        counts[out[0, 6] * V + out[0, 7]] += 1
        drafted += spec.last_stats.proposer("suffix").proposed
        accepted += spec.last_stats.proposer("suffix").accepted
    assert _chi2_pvalue(counts, law.flatten()) > ALPHA
    assert drafted >= 2000 and accepted < 0.2 * drafted  # the unlikely token was rejected
    wrong = torch.zeros(V, V)
    wrong[unlikely, likely] = 1.0  # power: emitting the proposal whenever proposed
    assert _chi2_pvalue(counts, (0.5 * law + 0.5 * wrong).flatten()) < ALPHA


def test_the_suffix_proposer_is_off_unless_asked_for_and_settings_reach_it(target):
    assert autospec.Controller(target, None, store=False).suffix_memory is None
    spec = autospec.Controller(target, None, store=False, suffix={"max_requests": 2})
    assert spec.suffix_memory.settings.max_requests == 2
    with pytest.raises(ValueError, match="suffix= takes"):
        autospec.Controller(target, None, store=False, suffix={"requests": 2})
    # a call that asks for it by k= opens it with the defaults
    spec = autospec.Controller(target, None, store=False)
    from autospec.policies import Choice

    spec.generate(_requests(1)[0], max_new_tokens=5, do_sample=False, k=Choice(3, "suffix"))
    assert spec.suffix_memory is not None
    assert autospec.policies.as_policy("suffix:3").name == "suffix:3"
    assert autospec.policies.as_policy("suffix:3:2").name == "suffix:3:2"  # its shortest match
