"""The draft model's catch-up at batch > 1. The batched loop resumes the draft model with one
forward over every row's unseen tokens, padded to the widest row's gap: B × gap slots. That
forward is the prompt at the first draft block and a stretch's worth after k = 0. The loop
tells the policy the gap (``Context.gap``) and feeds each catch-up, in the tokens it took in,
to its path's fit in the pair's cost table. The batch cost model charges it shared over the
batch's tokens left, and replay charges it the same way. Unpriced, a batch's first draft
block took in every prompt for free."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_batch_policy import (
    PATH,
    T_DRAFT,
    batch_context,
    grid_costs,
    t_draft,
    t_target,
    warm_stats,
)
from test_catch_up_replay import Recorder  # a fixed k schedule, recording each gap
from test_draft_cost import Stretches

import autospec
from autospec.costs.price import batch_best_k, catch_up_per_token, expected_tokens
from autospec.ngram import NGRAM_NONE, encode_trace_value
from autospec.policies import Context, CostModelPolicy
from autospec.store.queries import TraceRow
from autospec.traces import TRACE_GREEDY
from autospec.tune.replay import Costs, simulate

from conftest import noisy_copy, tiny
from records import trace_row
from test_batch_exact import batch

B_PER_TOKEN = 0.001  # the catch-up fit below: C(g) = 1 ms per token taken in


def fitted(costs):
    """``costs`` (a cost table) with its path's catch-up fit measured."""
    for g in (10, 100, 400, 1000):
        costs.at(PATH).observe_catch_up(g, B_PER_TOKEN * g)
    return costs


def test_batch_best_k_charges_the_per_token_share_of_a_catch_up():
    curve = [0.8] * 8
    cost = {n: t_target(4, n) for n in range(1, 17)}
    k0, s0 = batch_best_k([curve] * 4, T_DRAFT, cost, 8)
    assert k0 > 0
    k, s = batch_best_k([curve] * 4, T_DRAFT, cost, 8, per_token=0.002)
    tokens = 4 * expected_tokens(curve, k)
    assert s == pytest.approx(tokens * cost[1] / (4 * (k * T_DRAFT + cost[k + 1]
                                                       + tokens * 0.002)))
    assert 1 < s < s0
    assert batch_best_k([curve] * 4, T_DRAFT, cost, 8, per_token=0.05) == (0, 1.0)


def test_the_catch_up_that_pays_at_batch_1_does_not_at_batch_4():
    """At batch 1 and at batch 4 the verification forward costs the same (flat up to 16 scored
    tokens), but the batch's catch-up takes in 4 rows' gaps. The same gap and tokens left that
    pay back one row's catch-up do not pay back four."""
    stats = warm_stats(0.8)
    costs, policy = fitted(grid_costs()), CostModelPolicy(proposers="draft")
    one = costs.at(PATH, 1)
    for n in range(1, 17):
        one.t_target[n] = t_target(1, n)
    one.t_draft = T_DRAFT
    single = Context(category="c", live=stats, costs=one, gap=300, remaining=20)
    assert policy.choose(single) > 0
    at4 = dict(remaining=20, gap=300)
    assert policy.choose(replace(batch_context(stats, 4, costs), **at4)) == 0
    # the price is the fit at 4 × 300 tokens, less one draft step at B = 4, over 4 × 20 tokens
    ctx = replace(batch_context(stats, 4, costs), **at4)
    priced = policy._catch_up(ctx, list(ctx.rows), t_draft(4), ("draft",))
    assert priced == pytest.approx((B_PER_TOKEN * 1200 - t_draft(4)) / 80)
    assert priced == catch_up_per_token(ctx.costs, 300, 80, rows=4, t_draft=t_draft(4))
    # the usual gap after a draft block, more tokens left to pay it back, or no fit yet: drafts
    for change in (dict(gap=2), dict(remaining=2000)):
        ctx = replace(batch_context(stats, 4, costs), **{**at4, **change})
        assert policy.choose(ctx) > 0, change
    cold = warm_stats(0.8)
    ctx = replace(batch_context(cold, 4, grid_costs()), **at4)
    assert policy._catch_up(ctx, list(ctx.rows), t_draft(4), ("draft",)) == 0.0
    assert policy.choose(ctx) > 0


def test_beside_the_n_gram_the_batch_shares_the_catch_up_as_batch_1_does():
    """With the n-gram proposer allowed, the draft model serves only the share of the tokens
    where the n-gram has no match (the category's): its catch-up is paid off over fewer."""
    stats = warm_stats(0.8, blocks=50)
    for _ in range(30):  # three quarters of the decision points have a match
        for matched in (True, True, True, False):
            stats.observe_match(matched, proposer="ngram")
    costs, policy = fitted(grid_costs()), CostModelPolicy()
    ctx = replace(batch_context(stats, 4, costs), remaining=50, gap=100,
                  proposers=("draft", "ngram"))
    alone = policy._catch_up(ctx, list(ctx.rows), t_draft(4), ("draft",))
    shared = policy._catch_up(ctx, list(ctx.rows), t_draft(4),
                              ("draft", "ngram"))
    assert alone == pytest.approx((B_PER_TOKEN * 400 - t_draft(4)) / 200)
    share = stats.unmatched_share("ngram")
    first = stats.curve("ngram", 1)[0]
    assert share < 0.4
    assert shared == pytest.approx(alone / (share + (1 - share) * (1 - first)))


class Gaps(Stretches):
    """k = 0 for 4 iterations, then 3 for 2, over and over; records the gap and batch size."""

    def __init__(self):
        super().__init__(k=3, off=4, on=2)
        self.seen: list[tuple[int, int]] = []

    def choose(self, ctx):
        self.seen.append((ctx.gap, ctx.batch_size))
        return super().choose(ctx)


def _three_rows(policy):
    """Three left-padded prompts of 6, 9 and 7 tokens, 30 new tokens each, greedy, no EOS,
    a draft that agrees with the target about half the time, under ``policy``."""
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.5), store=False, policy=policy)
    ids, mask = batch([6, 9, 7], seed=4)
    spec.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                  eos_token_id=None, category="c")
    return spec


def test_the_batched_loop_tells_the_widest_gap_and_feeds_each_catch_up():
    policy = Gaps()
    spec = _three_rows(policy)
    ks = [k for _prev, k, _o in policy.log]
    seen = policy.seen[: len(ks)]
    # the longest prompt, then one more per plain step, while all three rows run
    assert seen[:5] == [(9, 3), (10, 3), (11, 3), (12, 3), (13, 3)]
    resumed = [(g, b) for i, (g, b) in enumerate(seen)
               if ks[i] > 0 and (i == 0 or ks[i - 1] == 0)]
    after_block = [g for i, (g, _b) in enumerate(seen) if i and ks[i - 1] > 0]
    assert len(resumed) >= 3 and all(g > 2 for g, _b in resumed)
    assert after_block and all(g <= 2 for g in after_block)
    # each resumption fed one catch-up of the rows running × the widest gap to the fit
    live = spec.costs.at("eager", 3)  # the path's fit, whichever batch size reads it
    weights = [0.98 ** (len(resumed) - 1 - i) for i in range(len(resumed))]
    assert live.catch_up[0] == pytest.approx(sum(weights))
    assert live.catch_up[1] == pytest.approx(sum(w * b * g
                                                 for w, (g, b) in zip(weights, resumed)))
    assert live.catch_up_cost(30) is not None
    spec.close()


class RowsLeft(Stretches):
    """k = 0 for 2 iterations, then 3 for 2, over and over; records each row's tokens left."""

    def __init__(self):
        super().__init__(k=3, off=2, on=2)
        self.seen: list[tuple[int, ...]] = []

    def choose(self, ctx):
        assert len(ctx.remaining_rows) == ctx.batch_size and max(ctx.remaining_rows) == \
            ctx.remaining
        self.seen.append(ctx.remaining_rows)
        return super().choose(ctx)


def test_the_batched_loop_tells_each_rows_tokens_left():
    """Rows accept different numbers of draft tokens: each row's count falls by what it
    emitted (its accepted tokens and one more), and the policy sees every row's."""
    policy = RowsLeft()
    spec = _three_rows(policy)
    assert policy.seen[0] == (30, 30, 30)
    ragged = 0
    for before, after, (_prev, _k, outcome) in zip(policy.seen, policy.seen[1:], policy.log):
        if len(after) != len(before):
            break  # a row finished and left the batch
        assert after == tuple(b - a - 1 for b, a in zip(before, outcome.accepted_rows))
        ragged += len(set(after)) > 1
    assert ragged > 0
    spec.close()


# -- replay -------------------------------------------------------------------------------
T_D2 = 0.008
LINE = (0.01, 0.001)  # C(g) = 10 ms + 1 ms per token


def _costs(catch_up=LINE) -> Costs:
    return Costs(0.005, {1: 0.1, 2: 0.1, 4: 0.11},
                 {2: {1: 0.15, 2: 0.15, 4: 0.16}}, {2: T_D2}, catch_up=catch_up)


def _row(prompt_tokens: int, trace, ngram=None) -> TraceRow:
    return trace_row(TRACE_GREEDY, trace, lookups=None if ngram is None else {"ngram": ngram},
                     category="c", batch_size=2, prompt_tokens=prompt_tokens)


def test_replay_at_batch_charges_every_rows_gap_padded_to_the_widest():
    # two rows of 12 tokens, the draft right everywhere; prompts of 50 and 30 tokens.
    # k = 3 (both accept 3: g 0 → 4, gap 2), k = 0 twice (g 6, gaps 3, 4), k = 3 (6 → 10,
    # gap 2), then k = 3, clipped to 1 by what is left (10 → 12), after a block: no charge
    rows = [_row(50, [1] * 12), _row(30, [1] * 12)]
    policy = Recorder([3, 0, 0, 3, 3])
    res = simulate(rows, policy, _costs(), k_max=8)
    assert policy.gaps[:4] == [50, 2, 3, 4]
    charged = (LINE[0] + LINE[1] * 2 * 50 - T_D2) + (LINE[0] + LINE[1] * 2 * 4 - T_D2)
    assert res.catch_up_seconds == pytest.approx(charged)
    bare = simulate(rows, Recorder([3, 0, 0, 3, 3]), _costs(None), k_max=8)
    assert bare.catch_up_seconds == 0.0
    assert res.seconds - bare.seconds == pytest.approx(charged)
    assert res.tokens == bare.tokens == 24
    table = _costs().table()
    simulate(rows, Recorder([3, 0, 0, 3, 3]), _costs(), k_max=8, category="c", table=table)
    assert table.at(None, 2).catch_up[1] == pytest.approx(0.98 * 100 + 8)  # B × gap


def test_an_n_gram_row_the_draft_caught_up_on_starts_its_gap_over():
    """Hybrid at batch: row 1 has long matches and takes the n-gram's block, row 2 none and
    takes the draft model's. The draft's catch-up forward took in both rows, and the n-gram
    row keeps none of the draft's own proposals: its gap is its block's tokens, not its
    prompt plus them."""
    from autospec.policies.base import Choice

    ng = [encode_trace_value(3, 3)] * 12
    rows = [_row(40, [0] * 12, ng), _row(20, [1] * 12, [NGRAM_NONE] * 12)]
    policy = Recorder([Choice(3, "hybrid", 2), 0])
    simulate(rows, policy, _costs(), k_max=8)
    # it 1: the draft caught up on both rows (widest gap 40); the n-gram row accepts its 3
    # → gap 4 (not 44), the draft row accepts 3 of 3 → gap 2; it 2 sees the widest, 4
    assert policy.gaps[:2] == [40, 4]
