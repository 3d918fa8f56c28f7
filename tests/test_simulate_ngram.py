"""Replaying the n-gram proposer from its trace (``autospec.tune.replay``): blocks accept
min(agreeing tokens, k) where it had a match, are plain steps where it had none, and the
hybrid proposer switches to the draft model's trace where the match is short. Traces built
by hand; the live-vs-replay identity is in tests/test_ngram_store.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autospec.ngram import NGRAM_NONE, decode_trace_value, encode_trace_value
from autospec.policies import as_policy
from autospec.traces import TRACE_GREEDY
from autospec.tune.replay import Costs, simulate

COSTS = Costs(t_draft=0.01, t_target={1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1, 5: 0.1}, t_lookup={"ngram": 0.0})


def row(draft_bits, ngram_values):
    return SimpleNamespace(trace_kind=TRACE_GREEDY, trace=bytes(draft_bits), batch_size=1,
                           traces={"draft": bytes(draft_bits), "ngram": bytes(ngram_values)})


def test_trace_values_round_trip():
    assert encode_trace_value(0, 5) == NGRAM_NONE and decode_trace_value(NGRAM_NONE) is None
    assert decode_trace_value(encode_trace_value(3, 7)) == (3, 7)
    assert decode_trace_value(encode_trace_value(40, 99)) == (14, 16)  # clamped, still < 255


def test_ngram_blocks_replay_from_the_trace():
    # 10 positions. At 0: match n=2 agreeing on 3 tokens; at 4: no match; at 5: n=1, 0 agree;
    # at 6: n=3 agreeing on 2
    ng = [encode_trace_value(2, 3), 0, 0, 0, NGRAM_NONE, encode_trace_value(1, 0),
          encode_trace_value(3, 2), 0, 0, NGRAM_NONE]
    res = simulate([row([0] * 10, ng)], as_policy("ngram:4"), COSTS)
    # iterations: g=0 block of 4 accepts 3 (+1) → g=4; no match: plain → g=5; block accepts 0
    # → g=6; block of min(4, remaining-1=3) accepts 2 → g=9; last: no match, plain → g=10
    assert res.tokens == 10 and res.iterations == 5
    assert res.proposer("ngram").accepted == 3 + 0 + 2 and res.drafted == 0
    assert res.proposer("ngram").proposed == 4 + 4 + 3
    assert res.seconds == pytest.approx(5 * 0.1)  # flat verification, free lookups
    assert res.speedup == pytest.approx(2.0)


def test_hybrid_takes_the_draft_where_the_match_is_short():
    draft = [1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    ng = [encode_trace_value(1, 5)] * 10  # every match is one token long
    long = simulate([row(draft, ng)], as_policy("hybrid:3:2"), COSTS)
    assert long.proposer("ngram").proposed == 0 and long.drafted > 0  # min_match 2: never the n-gram's
    short = simulate([row(draft, ng)], as_policy("hybrid:3:1"), COSTS)
    assert short.drafted == 0 and short.proposer("ngram").proposed > 0


def test_without_an_ngram_trace_the_policy_sees_the_draft_only():
    old = SimpleNamespace(trace_kind=TRACE_GREEDY, trace=bytes([1] * 8), batch_size=1,
                          traces={"draft": bytes([1] * 8)})
    res = simulate([old], as_policy("hybrid:3:1"), COSTS)
    assert res.proposer("ngram").proposed == 0 and res.drafted > 0
    res = simulate([old], as_policy("ngram:3"), COSTS)
    assert res.proposer("ngram").proposed == 0 and res.drafted == 0 and res.tokens == 8  # plain


def test_a_pair_without_a_draft_replays_the_ngram_whatever_the_policy_returns():
    ng = [encode_trace_value(2, 4)] * 12
    res = simulate([row([255] * 12, ng)], as_policy(3), COSTS, has_draft=False)
    assert res.drafted == 0 and res.proposer("ngram").proposed > 0
    auto = simulate([row([255] * 12, ng)], as_policy("auto"), COSTS, has_draft=False)
    assert auto.proposer("ngram").accepted > 0 and auto.speedup > 1.0


def test_a_cost_model_with_its_own_discount_learns_the_ngram_as_auto_does():
    """A cost-model policy that keeps its own discounted acceptance (every trial of `autospec
    tune`'s costmodel family, trial 0 included) decides by the controller's n-gram counts,
    catch-ups and costs as they grow, and counts only the draft model's blocks as the draft
    model's acceptance. With its own statistics a full copy fed only the draft's
    observations, a cold category never learned that lookup pays, and n-gram blocks were
    counted as the draft model's: trial 0 ("auto") replayed copy-heavy traffic at half of
    what `auto` itself replayed on the same traces."""
    from autospec.policies.tuned import build_policy
    from autospec.tune.study import default_params, params_of

    # copy-heavy traffic: every position has a 3-token match agreeing 12 tokens on; the draft
    # model's own proposals are accepted one time in four
    rows = [row([1, 0, 0, 0] * 16, [encode_trace_value(3, 12)] * 64) for _ in range(6)]
    # the default pair's probe on a 2-core CPU (bf16): T_d a third of T_t(1), flat to 16
    costs = Costs(t_draft=0.073, t_target={1: .228, 2: .191, 3: .206, 4: .197, 5: .214,
                                           6: .222, 7: .238, 8: .25, 10: .254, 16: .283})
    auto = simulate(rows, as_policy("auto"), costs)
    trial0 = simulate(rows, build_policy(*params_of(default_params())), costs)
    assert auto.proposer("ngram").proposed > 0  # the traffic is one where lookup pays
    assert (trial0.proposer("ngram").proposed, trial0.drafted, trial0.iterations) == (
        auto.proposer("ngram").proposed, auto.drafted, auto.iterations)
    assert trial0.speedup == pytest.approx(auto.speedup)
