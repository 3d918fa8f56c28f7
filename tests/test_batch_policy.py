"""Policies at batch > 1: the batch cost model on synthetic costs (verification flat at batch 1,
compute-bound at batch 16), the cost table's batch grid across batch sizes, the table policy,
the bandit's batch-size buckets."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from autospec.costs.measure import MEASURE
from autospec.costs.price import (
    batch_best_k,
    batch_finish_k,
    best_k,
    expected_max,
    expected_tokens,
    finish_speedups,
    finish_tokens,
)
from autospec.costs.table import CostTable
from autospec.policies import (
    Context,
    CostModelPolicy,
    Heuristic,
    LiveStats,
    Outcome,
    TablePolicy,
    ThompsonBandit,
    TunedPolicy,
    as_policy,
    batch_bucket,
    build_policy,
)

BATCHES = (1, 2, 4, 8, 16, 32)
T_DRAFT = 0.02
PATH = "eager"  # the execution path every table here keeps its costs under
NAN = float("nan")


def t_target(batch: int, n: int) -> float:
    """Memory-bound until B·n = 16 scored tokens, then compute-bound (∝ B·n)."""
    return 0.1 * max(1.0, batch * n / 16)


def t_draft(batch: int) -> float:
    return T_DRAFT * max(1.0, batch / 32)


def grid_costs() -> CostTable:
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {b: {n: t_target(b, n) for n in range(1, 17)} for b in BATCHES},
                    {b: t_draft(b) for b in BATCHES})
    return costs


def warm_stats(alpha: float, blocks: int = 400) -> LiveStats:
    """A category whose every draft position is accepted with probability alpha."""
    stats = LiveStats(discount=1.0)
    cum = [alpha ** (i + 1) for i in range(16)]
    stats.warm_start({"draft": ([c * blocks for c in cum], [blocks] * 16)}, weight=blocks)
    return stats


def batch_context(stats, batch: int, costs, *, category: str = "c", k_max: int = 16,
                  remaining: int = 48):
    """A batch of one category's rows, each with ``remaining`` tokens still to generate, and
    ``costs`` (a ``CostTable``) at its batch size."""
    return Context(category=category, k_max=k_max, batch_size=batch, remaining=remaining,
                   categories=(category,) * batch, rows=(stats,) * batch,
                   costs=costs.at(PATH, batch))


# -- the batch cost model ---------------------------------------------------------------------

def test_costmodel_speculates_at_batch_1_and_turns_off_at_batch_16():
    stats = warm_stats(0.8)
    policy, costs = CostModelPolicy(), grid_costs()
    one = costs.at(PATH, 1)
    for n in range(1, 17):  # batch 1 reads its own row's timings, as before
        one.t_target[n] = t_target(1, n)
    one.t_draft = T_DRAFT
    assert policy.choose(Context(category="c", live=stats, costs=one)) > 0
    assert policy.choose(batch_context(stats, 4, costs)) > 0  # 4 × (k + 1) still cheap
    assert policy.choose(batch_context(stats, 16, costs)) == 0
    assert policy.choose(batch_context(stats, 32, costs)) == 0


def test_low_acceptance_turns_speculation_off_even_where_verification_is_cheap():
    costs = grid_costs()
    assert CostModelPolicy().choose(batch_context(warm_stats(0.8), 2, costs)) > 0
    assert CostModelPolicy().choose(batch_context(warm_stats(0.05), 2, costs)) == 0


def test_batch_best_k_of_one_row_is_best_k():
    cost = {n: t_target(1, n) for n in range(1, 17)}
    for alpha in (0.3, 0.6, 0.9):
        curve = [alpha] * 8
        assert batch_best_k([curve], T_DRAFT, cost, 8) == pytest.approx(
            best_k(curve, T_DRAFT, cost, 8))


def test_batch_best_k_sums_every_rows_expected_tokens():
    good, bad = [0.9] * 4, [0.1] * 4
    cost = {n: t_target(4, n) for n in range(1, 17)}
    k, s = batch_best_k([good, good, bad, bad], T_DRAFT, cost, 4)
    tokens = 2 * expected_tokens(good, k) + 2 * expected_tokens(bad, k)
    assert k > 0
    assert math.isclose(s, tokens * cost[1] / (4 * (k * T_DRAFT + cost[k + 1])))
    # a batch of only the bad rows does not pay
    assert batch_best_k([bad] * 4, T_DRAFT, cost, 4) == (0, 1.0)


def _steps(batch_cost=t_target, draft=t_draft):
    return lambda b, k: batch_cost(b, k + 1) + k * draft(b) if k else batch_cost(b, 1)


def test_batch_finish_k_of_rows_alike_is_batch_best_k_where_blocks_do_not_spread():
    """One curve, one remaining length, every block accepted whole: every row finishes
    together, so how much sooner the batch finishes is Σ E[N_i] per second against plain's —
    with the catch-up paid once. (Blocks that can fail spread the rows: below.)"""
    for batch in (2, 4, 16):
        cost = lambda n, b=batch: t_target(b, n)  # noqa: E731
        for per_token in (0.0, 0.002):
            curve = [1.0] * 8
            k, s = batch_best_k([curve] * batch, t_draft(batch), cost, 8, per_token=per_token)
            got = batch_finish_k([curve] * batch, [40] * batch, _steps(), 8,
                                 once=per_token * 40 * batch)
            assert got[0] == k and got[1] == pytest.approx(s), (batch, per_token)


@pytest.mark.parametrize("alpha,k", [(0.65, 1), (0.65, 3), (0.85, 2)])
def test_a_batch_waits_for_its_unluckiest_row(alpha, k):
    """Eight rows alike, 48 tokens each: a call returns when the row whose blocks failed most
    is done, later than 48 / E[N] iterations. Simulated (each position accepted with
    probability ``alpha``), the last row's iterations agree with the finish's within 3 %,
    where 48 / E[N] alone is more than 4 % short of them; at one row they are 48 / E[N]."""
    rows, tokens, trials = 8, 48, 3000
    rng = random.Random(0)

    def iterations() -> int:
        n = done = 0
        while done < tokens:
            emitted = 1
            while emitted <= k and rng.random() < alpha:
                emitted += 1
            done, n = done + emitted, n + 1
        return n

    simulated = statistics.fmean(max(iterations() for _ in range(rows)) for _ in range(trials))
    flat = lambda b, j: 1.0  # noqa: E731  (every step costs the same: seconds = iterations)
    model = tokens / finish_speedups([[alpha] * k] * rows, [tokens] * rows, flat, k)[-1]
    mean = tokens / expected_tokens([alpha] * k, k)
    assert model == pytest.approx(simulated, rel=0.03)
    assert mean < simulated * 0.96
    one = tokens / finish_speedups([[alpha] * k], [tokens], flat, k)[-1]
    assert one == pytest.approx(mean)


def test_a_slow_row_holds_the_batch_to_its_pace():
    """A generate call returns with its last row. Three rows that accept almost everything
    and one that accepts little, all with 48 tokens to go: a long k finishes the three early
    and the slow row then runs on at its own pace, so the batch finishes sooner at the slow
    row's k. Σ E[N_i] (``batch_best_k``) counts the fast rows' tokens as gained all the same.
    Once the slow row is nearly done, the fast rows set the pace and the long k returns."""
    costs = {n: 0.2 * (1 + 0.02 * (n - 1)) for n in range(1, 18)}  # flat-ish: CPU at B = 4

    def step(b, k):
        return costs[k + 1] + k * 0.065 if k else costs[1]

    fast, slow = [0.94] * 16, [0.6] * 16
    rows = [fast, fast, fast, slow]
    k_sum, _ = batch_best_k(rows, 0.065, costs, 16)
    k_fin, s_fin = batch_finish_k(rows, [48] * 4, step, 16)
    assert k_fin < k_sum
    k_slow, s_slow = batch_finish_k([slow] * 4, [48] * 4, step, 16)
    assert (k_fin, s_fin) == (k_slow, pytest.approx(s_slow))  # the slow row's own pace
    k_late, _ = batch_finish_k(rows, [48, 48, 48, 2], step, 16)
    assert k_late == batch_finish_k([fast] * 3, [48] * 3, step, 16)[0] > k_fin
    # and by hand: the chosen k's finish is the phases' sum, each row read expected_max(4)
    # spreads late (P(N ≥ j) = a^(j − 1): E[N] = Σ a^(j − 1), E[N²] = Σ (2j − 1) a^(j − 1));
    # plain's all rows at 48 steps
    def late(a: float) -> float:
        mean = sum(a ** (j - 1) for j in range(1, k_fin + 2))
        var = sum((2 * j - 1) * a ** (j - 1) for j in range(1, k_fin + 2)) - mean ** 2
        return 48 / mean + expected_max(4) * math.sqrt(48 * var / mean ** 3)

    need = sorted(max(1.0, late(c[0])) for c in rows)
    spent, done = 0.0, 0.0
    for j, n in enumerate(need):
        spent, done = spent + (n - done) * step(4 - j, k_fin), n
    assert s_fin == pytest.approx(48 * costs[1] / spent)


def test_a_row_leaving_the_batch_makes_the_rest_cheaper_where_steps_cost_by_rows():
    """Where a step costs in proportion to the rows in it (compute-bound), rows that finish
    early make every later step cheaper: fast rows beside a slow one are worth more than a
    batch of slow rows. Where a step costs the same whatever the rows, they are not."""
    fast, slow = [0.95] * 16, [0.5] * 16

    def flat(b, k):
        return 0.2 + 0.065 * k

    def by_rows(b, k):
        return flat(b, k) * b / 4

    mixed, slows, left = [fast] * 3 + [slow], [slow] * 4, [48] * 4
    assert batch_finish_k(mixed, left, by_rows, 16)[1] > batch_finish_k(slows, left, by_rows,
                                                                           16)[1] + 0.05
    assert batch_finish_k(mixed, left, flat, 16) == (
        batch_finish_k(slows, left, flat, 16)[0],
        pytest.approx(batch_finish_k(slows, left, flat, 16)[1]))


def test_costmodel_speculates_by_each_rows_tokens_left():
    stats_fast, stats_slow = warm_stats(0.95), warm_stats(0.55)
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {b: {n: 0.2 * (1 + 0.02 * (n - 1)) for n in range(1, 17)}
                           for b in (1, 2, 4)}, {b: 0.065 for b in (1, 2, 4)})
    policy = CostModelPolicy()
    ctx = Context(category="fast", batch_size=4, remaining=48, costs=costs.at(PATH, 4),
                  categories=("fast", "fast", "fast", "slow"),
                  rows=(stats_fast, stats_fast, stats_fast, stats_slow))
    together = policy.choose(replace(ctx, remaining_rows=(48, 48, 48, 48)))
    slow_done = policy.choose(replace(ctx, remaining_rows=(48, 48, 48, 2)))
    assert 0 < together < slow_done
    assert policy.choose(ctx) == together  # no per-row counts: every row has ``remaining``


def test_finish_tokens_count_a_rows_tokens_by_what_they_bring_the_end_closer():
    """One row: E[N]. Rows gaining alike: Σ E[N_i] − B + 1 whatever the step costs. On steps
    that cost the same whatever the rows, tokens of rows that then wait for the last one count
    nothing; on steps that cost by the rows, each counts what its row costs a step."""

    def flat(b, k):
        return 0.2

    def by_rows(b, k):
        return 0.05 * b

    assert finish_tokens([2.5], [40], flat, 0.2) == pytest.approx(2.5)
    for step in (flat, by_rows):
        rate = step(4, 0) / 4
        assert finish_tokens([2.5] * 4, [40] * 4, step, rate) == pytest.approx(4 * 2.5 - 3)
    # three rows gain 1.5 tokens each, the fourth (the last to finish) none
    assert finish_tokens([2.5] * 3 + [1.0], [40] * 4, flat, 0.05) == pytest.approx(1.0)
    assert finish_tokens([2.5] * 3 + [1.0], [40] * 4, by_rows, 0.05) == pytest.approx(
        1 + 3 * 1.5)  # each a row's step, 0.05 s: as many as Σ E[N_i] − B + 1 says


def _lookup_rows(agree: int) -> LiveStats:
    """A category whose prompt lookup, from a 3-token match, holds ``agree`` of 16 tokens (its
    shadows) and whose draft model is accepted 0.2 of the time."""
    stats = warm_stats(0.2)
    for _ in range(40):
        stats.observe_shadow("ngram", 3, agree, 16)
    return stats


def test_a_lookup_block_is_worth_what_it_brings_the_batch_end_closer():
    """B = 16 on costs nearly flat in the rows (a row adds 2 ms to a 244 ms step, as the
    default pair's in bf16 on a CPU): prompt lookup matching 11 rows of 16, all with 48 tokens
    to go, speeds rows that then wait for the other five — the call's end comes no closer, and
    ``auto`` decodes plainly where Σ E[N_i] (``batch_best_k``) prices the block as paying.
    Once the five are nearly done the matched rows set the end, and the block pays."""
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {b: {n: 0.21 + 0.0021 * b * n for n in range(1, 18)}
                           for b in (1, 2, 4, 8, 16)}, {b: 0.1 for b in (1, 2, 4, 8, 16)})
    stats = _lookup_rows(12)
    matched = (3,) * 11 + (0,) * 5
    ctx = Context(category="c", k_max=16, batch_size=16, remaining=48,
                  costs=costs.at(PATH, 16), categories=("c",) * 16, rows=(stats,) * 16,
                  remaining_rows=(48,) * 16, proposers=("draft", "ngram"),
                  matches={"ngram": matched}, sizes={"ngram": (16,) * 16})
    curve = stats.curve("ngram", 16, match=3)
    curves = [curve] * 11 + [[0.0] * 16] * 5
    k_sum, s_sum = batch_best_k(curves, 0.0, costs.target_cost(PATH, 16), 16)
    assert k_sum > 0 and s_sum > 1.2  # by the rows' tokens it pays
    why: list = []
    assert policy_choice(CostModelPolicy(), replace(ctx, why=why)) == (0, None)
    ngram = next(c for c in why[0]["candidates"] if c["proposer"] == "ngram")
    assert ngram["speedup"] < 1  # by the batch's end it does not
    ending = replace(ctx, remaining_rows=(48,) * 11 + (2,) * 5)
    k, proposer = policy_choice(CostModelPolicy(), ending)
    assert proposer == "ngram" and k > 0
    assert policy_choice(CostModelPolicy(k_cap=0), ending) == (0, None)  # no k to weigh


def test_a_batch_block_scores_at_most_twice_the_widest_n_measured_at_its_batch_size():
    """B = 12 where the grid holds T_t(12, n) only for n ≤ 3 (costs flat in n there, as a
    memory-bound step's): prompt lookup matches every row with 16 tokens that all hold, so
    the extrapolation would price its whole draft (k = 16, 204 tokens scored) as nearly free.
    The block is priced at most at k + 1 = 2 · 3; once n = 8 is measured, up to k = 15."""
    stats = _lookup_rows(16)
    grid = {1: 0.20, 2: 0.201, 3: 0.202}
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {12: grid}, {12: 0.1})
    ctx = Context(category="c", k_max=16, batch_size=12, remaining=48,
                  costs=costs.at(PATH, 12), categories=("c",) * 12, rows=(stats,) * 12,
                  remaining_rows=(48,) * 12, proposers=("draft", "ngram"),
                  matches={"ngram": (3,) * 12}, sizes={"ngram": (16,) * 12})
    why: list = []
    assert policy_choice(CostModelPolicy(), replace(ctx, why=why)) == (5, "ngram")
    ngram = next(c for c in why[0]["candidates"] if c["proposer"] == "ngram")
    assert ngram["speedup"] > 2 and ngram["t_verify"] == pytest.approx(
        costs.target_cost(PATH, 12)(6))
    wider = CostTable(live=False)
    wider.warm_grid(PATH, {12: {**grid, 8: 0.21}}, {12: 0.1})
    assert policy_choice(CostModelPolicy(), replace(ctx, costs=wider.at(PATH, 12))) == (
        15, "ngram")


def policy_choice(policy, ctx) -> tuple[int, str | None]:
    """(k, the lookup's name, None for the draft model or a plain step) of one decision."""
    choice = policy.choose(ctx)
    return int(choice), getattr(choice, "proposer", None)


def test_batch_exploration_prices_only_what_is_not_measured():
    """At B > 1 with T_d(B) not measured, the exploring block takes T_d as free but the
    category's acceptance as measured (perfect only where the category is thin)."""
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {4: {n: t_target(4, n) for n in range(1, 17)}}, {})
    for stats, source in ((warm_stats(0.6), "live"), (LiveStats(), "perfect")):
        why: list = []
        policy = CostModelPolicy()
        k = policy.choose(replace(batch_context(stats, 4, costs), why=why))
        (record,) = why
        assert record["rule"] == "explore" and int(k) == policy.params.initial_k
        draft = next(c for c in record["candidates"] if c["proposer"] == "draft")
        assert draft["acceptance_from"] == source and draft["t_propose"] == 0.0
        expected = [1.0] * 3 if source == "perfect" else stats.curve("draft", 3)
        assert draft["acceptance"] == pytest.approx(expected)


def test_batch_exploration_prices_perfect_only_the_rows_whose_category_is_thin():
    """B = 4, the first row of a category not yet seen, three of one the draft serves poorly
    (0.3, measured): only the new row's acceptance is unknown, and the slow rows hold the
    batch's end whatever it turns out to be — nothing to explore (before, the first row's
    thinness priced every row's acceptance as perfect, and the draft explored at S ≈ 1.6)."""
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {4: {n: t_target(4, n) for n in range(1, 17)}}, {4: 0.05})
    new, poor = LiveStats(), warm_stats(0.3)
    ctx = Context(category="new", k_max=16, batch_size=4, remaining=48,
                  costs=costs.at(PATH, 4), categories=("new",) + ("poor",) * 3,
                  rows=(new,) + (poor,) * 3, remaining_rows=(48,) * 4)
    why: list = []
    assert CostModelPolicy().choose(replace(ctx, why=why)) == 0
    assert why[0]["rule"] == "off"
    alike = replace(ctx, categories=("new",) * 4, rows=(new,) * 4, why=[])
    assert int(CostModelPolicy().choose(alike)) > 0 and alike.why[0]["rule"] == "explore"


def test_min_gain_is_measured_against_plain_batched_decoding():
    stats, costs, why = warm_stats(0.8), grid_costs(), []
    k = CostModelPolicy().choose(replace(batch_context(stats, 4, costs), why=why))
    s = next(c["speedup"] for c in why[0]["candidates"] if c["proposer"] == "draft")
    assert k > 0 and s > 1
    assert CostModelPolicy(min_gain=s - 1 - 1e-9).choose(batch_context(stats, 4, costs)) == k
    assert CostModelPolicy(min_gain=s - 1 + 1e-3).choose(batch_context(stats, 4, costs)) == 0


def test_batch_exploration_measures_plain_then_drafts_then_turns_off():
    """Cold costs at batch 16: plain decoding first (measures T_t(16, 1)), then initial_k
    (measures the draft), then each k the optimistic curve still favours, once, then off."""
    stats, costs, policy = warm_stats(0.8), CostTable(live=False), CostModelPolicy(initial_k=3)
    ctx = batch_context(stats, 16, costs)
    ks = []
    for _ in range(12):
        k = ks.append(policy.choose(ctx)) or ks[-1]
        ctx.costs.observe(k, t_target(16, k + 1), t_draft(16) * k if k else NAN)
    assert ks[:2] == [0, 3]
    assert ks[-6:] == [0] * 6
    tried = [k for k in ks if k]
    assert len(tried) == len(set(tried))  # every k measured once is not tried again


def test_cold_rows_use_the_predicted_acceptance():
    cold, costs = LiveStats(), grid_costs()  # no evidence: the prior says 0.5
    policy = CostModelPolicy()
    ctx = batch_context(cold, 2, costs)
    assert policy.choose(ctx) < policy.choose(replace(ctx, predicted_alpha=0.97))
    assert policy.choose(replace(ctx, predicted_alpha=0.02)) == 0


# -- the cost table's batch grid -------------------------------------------------------------

def test_batch_costs_interpolate_linearly_across_batch_sizes_per_n():
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {4: {1: 0.1, 8: 0.4}, 16: {1: 0.3, 8: 1.6}}, {4: 0.02, 16: 0.06})
    points = costs.target_points(PATH, 8)  # a third of the way from 4 to 16
    assert points == pytest.approx({1: 0.1 + 0.2 / 3, 8: 0.4 + 1.2 / 3})
    assert costs.draft_cost(PATH, 10) == pytest.approx(0.04)
    assert costs.target_cost(PATH, 8, optimistic=False)(8) == pytest.approx(0.8)


def test_batch_costs_extend_beyond_the_measured_batch_sizes():
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {4: {1: 0.1}, 8: {1: 0.2}}, {4: 0.02, 8: 0.03})
    assert costs.target_points(PATH, 16)[1] == pytest.approx(0.4)  # along the last two
    assert costs.draft_cost(PATH, 16) == pytest.approx(0.05)
    assert costs.target_points(PATH, 2)[1] == pytest.approx(0.05)  # downward: proportional
    flat = CostTable(live=False)  # noise made B = 8 cheaper: never extend down
    flat.warm_grid(PATH, {4: {1: 0.2}, 8: {1: 0.1}}, {})
    assert flat.target_points(PATH, 16)[1] == pytest.approx(0.1)
    assert flat.target_points(PATH, 2)[1] == pytest.approx(0.2)


def test_one_measured_batch_size_says_nothing_about_another():
    costs = CostTable(live=False)
    costs.at(PATH, 1).observe(0, 0.1)
    costs.at(PATH, 1).observe(1, 0.1, 0.02)
    assert costs.target_cost(PATH, 16) is None and costs.draft_cost(PATH, 16) is None
    assert costs.target_cost(PATH, 1)(4) == pytest.approx(0.1)


def test_live_points_replace_warm_values_then_average():
    costs = CostTable(measure=MEASURE.but(cost_ema=0.5))  # a live loop's: it reads its rows
    costs.warm_grid(PATH, {4: {1: 1.0, 2: 1.0}}, {4: 1.0})
    row = costs.at(PATH, 4)
    version = row.version
    row.observe(0, 0.2)
    row.observe(1, NAN, 0.01)  # a draft timing alone
    assert row.version > version  # what the policy derived from the grid is rebuilt
    target, draft = costs.snapshot(PATH)
    assert target[4] == {1: 0.2, 2: 1.0} and draft[4] == 0.01
    row.observe(0, 0.4)
    row.observe(1, NAN, 0.03)
    target, draft = costs.snapshot(PATH)
    assert target[4][1] == pytest.approx(0.3) and draft[4] == pytest.approx(0.02)
    costs.warm_grid(PATH, {4: {1: 9.0, 2: 2.0}}, {4: 9.0})  # a new grid keeps the live points
    target, draft = costs.snapshot(PATH)
    assert target[4] == pytest.approx({1: 0.3, 2: 2.0}) and draft[4] == pytest.approx(0.02)


@pytest.mark.parametrize("bad", [float("nan"), None, 0.0, -1.0, float("inf")])
def test_unusable_timings_are_ignored(bad):
    costs = CostTable(live=False)
    costs.at(PATH, 4).observe(1, bad, bad)
    assert costs.snapshot(PATH) == ({}, {}) and costs.target_cost(PATH, 4) is None


def test_target_cost_follows_new_points():
    costs = CostTable(live=False)
    row = costs.at(PATH, 2)
    row.observe(0, 0.1)
    assert costs.target_cost(PATH, 2)(1) == pytest.approx(0.1)
    row.observe(0, 0.3)
    assert costs.target_cost(PATH, 2)(1) == pytest.approx(0.2)  # median of the first samples
    row.observe(0, 0.3)
    assert costs.target_cost(PATH, 2)(1) == pytest.approx(0.3)
    row.observe(0, 0.5)  # settled: an EMA from here
    assert costs.target_cost(PATH, 2)(1) == pytest.approx(0.8 * 0.3 + 0.2 * 0.5)


def test_a_slow_first_forward_does_not_become_the_point():
    """The first forwards at a new batch size run slow (fresh allocations): on the default
    pair T_t(16, 1) read 466 ms once, then ~290 ms. A point is the median of its first
    ``settle`` samples, so one slow sample moves it by nothing; an EMA seeded with it
    (the rule before) kept it at 430 ms after three samples."""
    costs = CostTable()
    row = costs.at(PATH, 16)
    for t in (0.466, 0.290, 0.292):
        row.observe(0, t)
        row.observe(1, NAN, 0.235 if t > 0.4 else 0.165)
    assert costs.target_points(PATH, 16)[1] == pytest.approx(0.292)
    assert costs.draft_cost(PATH, 16) == pytest.approx(0.165)
    with pytest.raises(ValueError, match="settle"):
        CostTable(measure=MEASURE.but(cost_settle=0))


# -- the table policy -------------------------------------------------------------------------

def test_table_policy_maps_batch_sizes_to_k():
    policy = as_policy("table:1-2:4,3-8:2,9-:0")
    assert isinstance(policy, TablePolicy) and policy.name == "table:1-2:4,3-8:2,9-:0"
    assert [policy.choose(Context(batch_size=b)) for b in (1, 2, 3, 8, 9, 64)] == \
        [4, 4, 2, 2, 0, 0]
    assert policy.choose(Context(batch_size=1, k_max=3)) == 3


def test_table_policy_name_is_canonical_and_rebuilds_it():
    policy = as_policy("TABLE: 9-:0, 3-8:2 ,1-2:4")
    assert policy.name == "table:1-2:4,3-8:2,9-:0"
    assert as_policy(policy.name).ranges == policy.ranges
    assert TablePolicy({(1, 1): 3, (2, None): 1}).name == "table:1:3,2-:1"
    assert as_policy("table:1:3,2-:1").ranges == ((1, 1, 3), (2, None, 1))


@pytest.mark.parametrize("spec, message", [
    ("table:1-2:4,4-:0", "batch size 3 is not covered"),
    ("table:1-2:4,6-:0", "batch sizes 3-5 are not covered"),
    ("table:2-:1", "batch size 1 is not covered"),
    ("table:1-4:2", "above 4 are not covered"),
    ("table:1-4:2,3-:0", "1-4 and 3- overlap"),
    ("table:1-:2,5-:0", "overlap"),
    ("table:1-2:x,3-:0", "integers"),
    ("table:1-2,3-:0", "not 'LO-HI:K'"),
    ("table:", "no ranges"),
    ("table:4-2:1,1-:0", "empty"),
    ("table:1-:-1", "k must be in 0..64"),
    ("table:1-:65", "k must be in 0..64"),
    ("table:0-:1", "start at 1"),
])
def test_bad_table_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        as_policy(spec)


def test_table_from_dict_and_from_per_batch_choices():
    assert TablePolicy({(1, 2): 4, (3, 8): 2, (9, None): 0}).name == "table:1-2:4,3-8:2,9-:0"
    table = TablePolicy.from_choices({1: 4, 4: 2, 16: 0})
    assert table.name == "table:1-3:4,4-15:2,16-:0"
    assert TablePolicy.from_choices({2: 3, 4: 3, 8: 0}).name == "table:1-7:3,8-:0"


def test_tuned_row_may_hold_a_table():
    policy = build_policy("table", {"table": {"1": 3, "8": 0}, "early_stop": 0.4})
    assert policy.name == "table:1-7:3,8-:0+stop=0.4"
    assert policy.choose(Context(batch_size=8)) == 0


def test_tuned_table_serves_a_batch_by_its_most_common_category(tmp_path):
    from test_tune import PAIR, make_store

    from autospec.store import add_tuned_params, queries

    with make_store(tmp_path / "t.db", {"code": (0.8, 2), "chat": (0.5, 2)}) as store:
        with store.begin() as s:
            pid = queries.pair_id(s, PAIR)
            add_tuned_params(s, category="code", pair_id=pid, family="table",
                             params={"table": "1-3:4,4-:0"}, tokens_per_s=1.0,
                             baseline_tokens_per_s=None, provenance={})
            add_tuned_params(s, category="chat", pair_id=pid, family="fixed",
                             params={"k": 1}, tokens_per_s=1.0, baseline_tokens_per_s=None,
                             provenance={})
        policy = TunedPolicy()
        policy.attach(queries.tuned_fetcher(store, PAIR))
        try:
            def batch(*cats):
                return Context(batch_size=len(cats), categories=cats)

            assert policy.choose(batch("chat", "code", "code")) == 4
            assert policy.choose(batch("chat", "code", "code", "code")) == 0
            assert policy.choose(batch("chat", "chat", "code")) == 1
        finally:
            policy.close()


# -- bandit and heuristic ---------------------------------------------------------------------

def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 500)] == \
        [1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32]


def test_bandit_keeps_batch_size_buckets_apart():
    """Batch 1 rewards k = 3, batch 16 rewards k = 0: each bucket finds its own arm."""
    bandit = ThompsonBandit(k_max=3, seed=1)

    def reward(batch: int, k: int) -> Outcome:
        rows = (k,) * batch  # every row accepts every draft token
        seconds = k * t_draft(batch) + t_target(batch, k + 1)
        return Outcome(drafted=k, accepted=k, accepted_rows=rows if batch > 1 else (),
                       batch_size=batch, draft_time_s=k * t_draft(batch),
                       target_time_s=seconds - k * t_draft(batch))

    contexts = {b: Context(category="c", k_max=3, batch_size=b,
                           categories=("c",) * b if b > 1 else ()) for b in (1, 16)}
    for _ in range(300):
        for b, ctx in contexts.items():
            k = bandit.choose(ctx)
            bandit.update(ctx, k, reward(b, k))
    late = {b: [bandit.choose(ctx) for _ in range(50)] for b, ctx in contexts.items()}
    assert late[1].count(3) >= 40
    assert late[16].count(0) >= 40
    # a batch of 17 shares batch 16's bucket
    bucket_mate = Context(category="c", k_max=3, batch_size=17, categories=("c",) * 17)
    assert [bandit.choose(bucket_mate) for _ in range(50)].count(0) >= 40


def test_bandit_rewards_a_batch_in_tokens_of_all_rows():
    """k = 2 yields rows (2, 2, 2, 0): 10 tokens, k = 1 rows (1, 1, 1, 1): 8, in equal time.
    Their floored mean (1 each) would tie them; all rows' tokens make k = 2 the winner."""
    bandit = ThompsonBandit(k_max=2, seed=0)
    ctx = Context(category="c", k_max=2, batch_size=4, categories=("c",) * 4)
    rows = {0: (0, 0, 0, 0), 1: (1, 1, 1, 1), 2: (2, 2, 2, 0)}
    for _ in range(200):
        k = bandit.choose(ctx)
        bandit.update(ctx, k, Outcome(drafted=k, accepted=sum(rows[k]) // 4,
                                      accepted_rows=rows[k], batch_size=4,
                                      draft_time_s=0.0, target_time_s=1.0))
    assert [bandit.choose(ctx) for _ in range(50)].count(2) >= 45


def test_heuristic_counts_a_batch_block_full_only_when_every_row_accepted_all():
    heuristic = Heuristic(start=4)
    ctx = Context(category="c", batch_size=2, categories=("c", "c"))
    heuristic.update(ctx, 4, Outcome(drafted=4, accepted=4, accepted_rows=(4, 3)))
    assert heuristic.choose(ctx) == 3
    heuristic.update(ctx, 3, Outcome(drafted=3, accepted=3, accepted_rows=(3, 3)))
    assert heuristic.choose(ctx) == 5


# -- live forwards recalibrate the probe's grid -----------------------------------------------
# Figures of the default pair on a 2-core CPU (bf16): the probe (context 200, no padding mask)
# against what the batched loop measured on 16 left-padded prompts in the same session.
PROBE = {8: {1: 0.282, 2: 0.322, 3: 0.381}, 16: {1: 0.401, 2: 0.461, 3: 0.602}}
PROBE_DRAFT = {8: 0.118, 16: 0.169}
LIVE_16 = {1: 0.267, 2: 0.407}
LIVE_DRAFT_16 = 0.165


def probe_costs(*, live: bool) -> CostTable:
    costs = CostTable(live=live)
    costs.warm_grid(PATH, PROBE, PROBE_DRAFT)
    return costs


def test_live_points_rescale_the_probe_where_the_loop_has_not_measured():
    costs = probe_costs(live=True)
    for n, t in LIVE_16.items():
        costs.at(PATH, 16).observe(n - 1, t, LIVE_DRAFT_16 * (n - 1))
    # at B = 12 (not measured live) each n takes the probe's value times live/probe at B = 16
    pts = costs.target_points(PATH, 12)
    for n in (1, 2):
        probe_12 = (PROBE[8][n] + PROBE[16][n]) / 2
        assert pts[n] == pytest.approx(probe_12 * LIVE_16[n] / PROBE[16][n])
    # n = 3 has no live point: the nearest n's factor (n = 2)
    probe_12_3 = (PROBE[8][3] + PROBE[16][3]) / 2
    assert pts[3] == pytest.approx(probe_12_3 * LIVE_16[2] / PROBE[16][2])
    # so the cost ratio the loop measured carries over, not the probe's
    assert pts[2] / pts[1] > 1.4 > (PROBE[8][2] + PROBE[16][2]) / (PROBE[8][1] + PROBE[16][1])
    assert costs.draft_cost(PATH, 12) == pytest.approx(
        (PROBE_DRAFT[8] + PROBE_DRAFT[16]) / 2 * LIVE_DRAFT_16 / PROBE_DRAFT[16])


def test_a_batch_size_with_a_live_baseline_takes_the_shape_at_its_own_level():
    """The machine ran 1.5× slow while B = 2 was measured (both n = 1 and n = 2), at its usual
    speed while B = 4 ran plain. B = 4's T_t(4, 2) is B = 4's live level times the probe's
    shape there, corrected by the shape B = 2 measured (none here: the same ratio), not the
    probe's T_t(4, 2) times B = 2's slow level (which read T_t(4, 2) / T_t(4, 1) at 1.5 × the
    probe's 1.15, and ran auto plain at B = 4 where k = 1 paid)."""
    probe = {1: {1: 0.160, 2: 0.165}, 2: {1: 0.140, 2: 0.145},
             4: {1: 0.141, 2: 0.163, 3: 0.179}, 8: {1: 0.171, 2: 0.191, 3: 0.220}}
    costs = CostTable()
    costs.warm_grid(PATH, probe, {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.08})
    for _ in range(MEASURE.cost_settle):
        costs.at(PATH, 2).observe(0, 1.5 * 0.140)
        costs.at(PATH, 2).observe(1, 1.5 * 0.145)
        costs.at(PATH, 4).observe(0, 0.141)
    pts = costs.target_points(PATH, 4)
    assert pts[1] == pytest.approx(0.141)
    assert pts[2] / pts[1] == pytest.approx(0.163 / 0.141)
    assert pts[3] / pts[1] == pytest.approx(0.179 / 0.141)  # n = 3: the nearest n's shape
    # a shape the loop measured does carry over: at B = 2 n = 2 costs 1.3× the probe's ratio
    for _ in range(60):  # the EMA settles on it
        costs.at(PATH, 2).observe(1, 1.5 * 0.145 * 1.3)
    pts = costs.target_points(PATH, 4)
    assert pts[2] / pts[1] == pytest.approx(0.163 / 0.141 * 1.3, rel=0.02)
    # a batch size without a live baseline keeps the per-n factors (live / probe at that n)
    assert costs.target_points(PATH, 8)[2] == pytest.approx(0.191 * 1.5 * 1.3, rel=0.01)


def test_live_costs_need_a_live_baseline_per_batch_bucket():
    costs = probe_costs(live=True)
    assert not costs.baseline_live(PATH, 16) and not costs.baseline_live(PATH, 12)
    for i in range(MEASURE.cost_settle):  # the baseline rests on settle samples, not one
        assert not costs.baseline_live(PATH, 16)
        costs.at(PATH, 16 if i else 17).observe(0, LIVE_16[1])
    assert costs.baseline_live(PATH, 16) and costs.baseline_live(PATH, 20)  # bucket 16–31
    assert not costs.baseline_live(PATH, 12)  # bucket 8–15
    assert probe_costs(live=False).baseline_live(PATH, 12)  # replay trusts its grid


def test_costmodel_switches_off_where_the_loop_measures_what_the_probe_missed():
    """The failure this guards against: the probe said k = 1 pays at B = 16 (S ≈ 1.15 at
    α ≈ 0.8), the loop's own forwards said it does not (S ≈ 0.84); the policy read the probe
    at every batch size the shrinking batch had not measured and kept k = 1 (0.81× plain)."""
    stats = warm_stats(0.8)
    policy = CostModelPolicy()
    costs = probe_costs(live=True)
    # a live baseline first: plain steps until it rests on settle samples; the first one
    # slow, as the first forwards at a new batch size are (it does not become the baseline)
    for t in (0.466, LIVE_16[1], LIVE_16[1]):
        assert policy.choose(batch_context(stats, 16, costs)) == 0
        costs.at(PATH, 16).observe(0, t)
    k = policy.choose(batch_context(stats, 16, costs))
    costs.at(PATH, 16).observe(k, LIVE_16[2] if k == 1 else 0.5, LIVE_DRAFT_16 * k)
    assert policy.choose(batch_context(stats, 16, costs)) == 0
    # a row leaves: B = 15 is another bucket — one plain step, then still off
    for _ in range(MEASURE.cost_settle):
        assert policy.choose(batch_context(stats, 15, costs)) == 0
        costs.at(PATH, 15).observe(0, 0.26)
    assert policy.choose(batch_context(stats, 15, costs)) == 0
    # where verification is cheap live as well, the same policy speculates
    cheap = probe_costs(live=True)
    for _ in range(MEASURE.cost_settle):
        cheap.at(PATH, 16).observe(0, 0.267)
    cheap.at(PATH, 16).observe(1, 0.280, 0.05)
    assert policy.choose(batch_context(stats, 16, cheap)) > 0


@pytest.mark.parametrize("ngram_alpha, left", [
    (0.5, (100, 100)),   # rows alike: the finish and the iteration agree
    (0.5, (100, 8)),     # a short row: the draft's finish ratio is not its block's
    (0.95, (100, 8)),    # a copy: prompt lookup's block saves the most
    (0.1, (100, 100)),   # chance matches: the draft model's block
])
def test_a_batch_runs_the_block_that_saves_the_most_seconds_at_the_rests_rate(ngram_alpha,
                                                                              left):
    """At batch > 1 the decision is batch 1's: each candidate's seconds saved against a plain
    step (B tokens for T_t(B, 1)) with the rest of the batch at the draft model's block's rate
    where it pays (T_t(B, 1) / (B · S_B)), else plain's — recomputed here from the record."""
    live = LiveStats()
    live.warm_start({"draft": ([400 * 0.8 ** (i + 1) for i in range(8)], [400] * 8),
                     "ngram": ([400 * ngram_alpha ** (i + 1) for i in range(8)], [400] * 8)})
    costs = CostTable(live=False)
    costs.at(PATH, 1).warm(t_draft=0.03, t_target={n: 0.2 for n in range(1, 18)}, probe=True,
                           t_lookup={"ngram": 1e-5})
    costs.warm_grid(PATH, {b: {n: 0.25 * b ** 0.2 * (1 + 0.02 * max(0, n - 3))
                               for n in range(1, 18)} for b in (1, 2)}, {1: 0.04, 2: 0.06})
    why: list = []
    k = CostModelPolicy().choose(Context(
        category="c", k_max=8, batch_size=2, live=live, rows=(live, live),
        categories=("c", "c"), costs=costs.at(PATH, 2), remaining=max(left),
        remaining_rows=left,
        proposers=("draft", "ngram"), matches={"ngram": (3, 3)}, why=why))
    record = why[0]
    t1, cands = record["t_plain"], {c["proposer"]: c for c in record["candidates"]}
    draft = cands["draft"]
    assert draft["k"] > 0 and draft["speedup"] > 1  # the draft model pays here
    assert (cands["plain"]["tokens"], cands["plain"]["spt"]) == (2.0, t1 / 2)  # a token a row
    rate = record["value"]  # the rest's: the draft model's block's rate, where it pays
    assert rate == pytest.approx(t1 / 2 / (draft["tokens"] * t1 / (2 * draft["block_s"])))
    for c in cands.values():
        if c["proposer"] != "plain":
            want = t1 + (c["tokens"] - 2) * rate - c["block_s"] - c["tokens"] * c["extra_s"]
            assert c["saved_s"] == pytest.approx(want)
    best = max((c for c in cands.values() if c["proposer"] != "plain"),
               key=lambda c: c["saved_s"])
    assert (int(k), getattr(k, "proposer", "draft")) == (best["k"], best["proposer"])
    assert best["proposer"] == ("ngram" if ngram_alpha > 0.9 else "draft") or ngram_alpha == 0.5


def test_a_categorys_ended_requests_say_how_many_tokens_a_row_has_left():
    stats = LiveStats()
    assert stats.expected_left(0, 48) == 48  # nothing ended yet: all it may
    for n in (6, 8, 10):
        stats.observe_length(n, capped=False)
    assert stats.expected_left(0, 48) == pytest.approx(8)
    assert stats.expected_left(7, 41) == 41  # two ran past 7 tokens: too few to say
    stats.observe_length(20, capped=True)  # stopped at its cap: it may run all it may
    assert stats.expected_left(0, 48) == pytest.approx((6 + 8 + 10 + 48) / 4)
    assert stats.copy().expected_left(0, 48) == stats.expected_left(0, 48)


def test_rows_whose_category_ends_early_do_not_hold_the_batchs_end():
    """B = 8: four rows of a category the draft serves well (0.8) and four of one it serves
    poorly (0.4), every row allowed 48 more tokens, a draft step at 0.1 s on a 0.23 s plain
    step. Held to 48 tokens, the poor rows set the end and k = 1 loses; where that
    category's requests are known to end after about 8 tokens, the good rows set it and the
    draft's block pays."""
    costs = CostTable(live=False)
    costs.warm_grid(PATH, {b: {n: 0.21 + 0.0021 * b * n for n in range(1, 18)}
                           for b in (1, 2, 4, 8)}, {b: 0.1 for b in (1, 2, 4, 8)})
    good, poor = warm_stats(0.8), warm_stats(0.4)
    ctx = Context(category="good", k_max=8, batch_size=8, remaining=48,
                  costs=costs.at(PATH, 8), categories=("good",) * 4 + ("poor",) * 4,
                  rows=(good,) * 4 + (poor,) * 4, remaining_rows=(48,) * 8,
                  generated_rows=(0,) * 8)
    assert CostModelPolicy().choose(ctx) == 0
    for n in (7, 8, 9):
        poor.observe_length(n, capped=False)
    assert CostModelPolicy().choose(ctx) > 0
