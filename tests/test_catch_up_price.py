"""The draft model's catch-up, priced: its first use in a request costs a forward over every
token it has not seen (the whole prompt), and after a stretch at k = 0 or of n-gram blocks, a
forward over those. The loop measures it (tokens fed, seconds), the pair's cost table fits
C(g) = a + b·g per execution path, ``LiveStats`` counts how often the n-gram proposer has a
match, and the cost model
charges a resumption its catch-up shared over the tokens the draft is expected to serve in
the rest of the request. Unpriced, auto paid a ~0.5 s catch-up over copy-heavy prompts to
draft the few steps prompt lookup had no match for, and ran 2.20× where prompt lookup alone
ran 3.05× (session 18's run on the default pair)."""

from __future__ import annotations

import pytest
from test_draft_cost import SLOW, Stretches, slow_catch_up  # noqa: F401 (a fixture)

import autospec
from autospec.costs.price import (
    best_k,
    best_offer,
    catch_up_per_token,
    expected_tokens,
    induced_catch_up,
    interpolate_cost,
    offer,
    saved,
    valued,
)
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy, LiveStats
from autospec.policies.costmodel import request_curve
from autospec.policies.params import DEFAULTS

from conftest import noisy_copy, prompt, tiny


def valued_speedup(curve, k, t_propose, cost, per_token, value):
    """S of the proposer's block of k valued at ``value`` seconds per token past its first."""
    cost = interpolate_cost(cost) if isinstance(cost, dict) else cost
    return valued(offer("draft", curve, k, t_propose, cost, per_token), cost(1), value)


def block_saving(curve, k, t_propose, cost, per_token, value):
    """Seconds the proposer's block of k saves with the rest at ``value`` per token."""
    cost = interpolate_cost(cost) if isinstance(cost, dict) else cost
    return saved(offer("draft", curve, k, t_propose, cost, per_token), cost(1), value)


def costs():
    """The pair's costs at batch 1 on one path (a fresh table's row)."""
    return CostTable().at("eager")


def test_catch_up_cost_is_fitted_from_the_catch_ups_seen():
    live = costs()
    assert live.catch_up_cost(100) is None  # nothing measured: nothing to price
    for g in (300, 5, 12, 250, 3, 40):
        live.observe_catch_up(g, 0.01 + 0.002 * g)
    assert live.catch_up_cost(100) == pytest.approx(0.21, rel=1e-6)
    assert live.catch_up_cost(1) == pytest.approx(0.012, rel=1e-6)
    live.t_draft = 0.05  # a catch-up is never cheaper than the proposal it includes
    assert live.catch_up_cost(1) == 0.05
    table = CostTable()
    one = table.at("eager")
    one.observe_catch_up(200, 0.4)  # a single size: proportional to it
    assert one.catch_up_cost(50) == pytest.approx(0.1)
    one.observe_catch_up(0, 1.0)  # nothing fed, or no time: ignored
    one.observe_catch_up(10, float("nan"))
    assert one.catch_up[0] == 1
    # the catch-up fit is the path's: every batch size's row reads it, in tokens taken in
    at4 = table.at("eager", 4)
    assert at4.catch_up is one.catch_up and table.at("static").catch_up[0] == 0
    alone = table.copy().at("eager")  # an independent copy (a replay's)
    assert alone.catch_up == one.catch_up and alone.catch_up is not one.catch_up


def test_the_unmatched_share_starts_at_all_and_follows_the_traffic():
    live = LiveStats(discount=1.0)
    assert live.unmatched_share("ngram") == 1.0  # unknown: the draft may serve it all
    for i in range(10):
        live.observe_match(i % 5 != 0, proposer="ngram")  # 2 of 10 points without a match
    assert live.unmatched_share("ngram") == pytest.approx((2 + 2) / (10 + 2))
    assert live.copy().by_proposer["ngram"].match_points == [2, 8]


def test_best_k_charges_the_per_token_share_of_a_catch_up():
    curve, cost = [0.8] * 8, {n: 0.1 + 0.005 * n for n in range(1, 10)}
    k0, s0 = best_k(curve, 0.02, cost, 8)
    assert k0 > 0 and s0 > 1.2
    k, s = best_k(curve, 0.02, cost, 8, per_token=0.01)
    e = expected_tokens(curve, k)
    assert s == pytest.approx(e * cost[1] / (k * 0.02 + cost[k + 1] + e * 0.01))
    assert 1 < s < s0
    assert best_k(curve, 0.02, cost, 8, per_token=0.1) == (0, 1.0)  # dearer than plain


def test_tokens_past_a_blocks_first_are_worth_the_rate_the_request_runs_at():
    curve, cost = [0.8] * 8, {n: 0.1 + 0.005 * n for n in range(1, 10)}
    k, _s = best_k(curve, 0.02, cost, 8)
    e = expected_tokens(curve, k)
    assert valued_speedup(curve, k, 0.02, cost, 0.0, 0.05) == pytest.approx(
        (cost[1] + (e - 1) * 0.05) / (k * 0.02 + cost[k + 1]))
    for k in range(1, 9):
        e = expected_tokens(curve, k)
        s = e * cost[1] / (k * 0.02 + cost[k + 1])
        # valued at T_t(1), a block is worth what S says
        assert valued_speedup(curve, k, 0.02, cost, 0.0, cost[1]) == pytest.approx(s)
        # where the block's own proposer sets the rate, it still pays exactly where S says so
        own = (k * 0.02 + cost[k + 1]) / e
        assert (valued_speedup(curve, k, 0.02, cost, 0.0, own) > 1) == (s > 1)
    # a much cheaper continuation (prompt lookup): a long dear block loses to a plain step
    assert valued_speedup(curve, 8, 0.02, cost, 0.0, 0.01) < 1 < best_k(curve, 0.02, cost, 8)[1]


def test_a_blocks_seconds_saved_agree_with_its_valued_speedup_on_whether_it_pays():
    curve, cost = [0.7] * 8, {n: 0.1 + 0.005 * n for n in range(1, 10)}
    for k in range(1, 9):
        for value, per_token in ((0.1, 0.0), (0.04, 0.0), (0.06, 0.01)):
            e = expected_tokens(curve, k)
            want = (cost[1] + (e - 1) * value) - (k * 0.02 + cost[k + 1] + e * per_token)
            saved = block_saving(curve, k, 0.02, cost, per_token, value)
            assert saved == pytest.approx(want)
            assert (saved > 0) == (valued_speedup(curve, k, 0.02, cost, per_token, value) > 1)


def test_decide_takes_the_paying_block_that_saves_the_most_seconds():
    """The one decision: blocks below S = 1 + min_gain at the rate are out; of the rest, the
    most seconds saved wins (the first among ties); none paying is a plain step."""
    cost = interpolate_cost({n: 0.1 + 0.005 * n for n in range(1, 10)})
    t1 = cost(1)
    cheap = offer("ngram", [0.3] * 8, 2, 1e-6, cost)  # the best ratio, few tokens
    dear = offer("draft", [0.8] * 8, 4, 0.02, cost)  # more seconds saved
    assert valued(cheap, t1) > 1 and valued(dear, t1) > 1
    assert saved(dear, t1) > saved(cheap, t1) > 0
    assert best_offer([cheap, dear], t1, None, 0.0) is dear
    # the draft's block charged a catch-up it would cause elsewhere drops below the lookup's
    charged = dear._replace(induced=saved(dear, t1) - saved(cheap, t1) + 1e-3)
    assert best_offer([cheap, charged], t1, None, 0.0) is cheap
    # a gain neither reaches: plain decoding
    gain = max(valued(cheap, t1), valued(dear, t1))
    assert best_offer([cheap, dear], t1, None, gain) is None
    # at a rate far below T_t(1) (copies run almost free) the dear block no longer pays
    assert valued(dear, t1, 0.01) < 1 and best_offer([dear], t1, 0.01, 0.0) is None
    assert best_offer([dear, dear], t1, None, 0.0) is dear and best_offer([], t1, None, 0.0) is None


def test_the_proposers_are_ranked_by_the_seconds_their_blocks_save():
    """Chat-like traffic on a memory-bound CPU (the default pair, session 28): the draft's
    blocks hold 0.74 per position at T_d = 75 ms; the n-gram proposer's chance hits from a
    1-token match hold 0.2, free to propose and as cheap to verify (flat T_t). Against a
    plain step the lookup block reads the higher ratio (it costs less), but the draft's
    block saves more seconds, so the request ends sooner with it: the policy drafts. Ranked
    by the ratio, auto spent a third of chat's steps on lookup blocks accepted 0.035–0.09
    of their tokens and lost to fixed k = 1 (1.08 against 1.23)."""
    live, pair = LiveStats(discount=1.0), costs()
    for i in range(80):
        live.observe(1, (1, 1, 1, 0)[i % 4], 0.075, 0.229)
        pair.observe(1, 0.229, 0.075)
        live.observe_shadow("ngram", 1, int(i % 5 == 0), 1)
    pair.t_target = {n: 0.228 + 0.001 * (n - 1) for n in range(1, 18)}
    pair.t_draft, pair.t_lookup["ngram"] = 0.075, 1e-6
    live.spent = [0.15 * 400, 400]  # the category runs at 0.15 s per token
    policy = CostModelPolicy(stop_rule=False)  # the block as priced (its stop: test_stopping)
    curve, cost = policy.derived(live, "draft", 8), policy.derived_cost(pair)
    lookup = policy.derived(live, "ngram", 8, 1)
    kd, _ = best_k(curve, 0.075, cost, 8)
    kn, _ = best_k(lookup, 1e-6, cost, 8)
    assert kd > 0 and kn > 0
    value = 0.15
    # the premise: the ratio prefers the lookup, the seconds saved the draft
    assert (valued_speedup(lookup, kn, 1e-6, cost, 0.0, value)
            > valued_speedup(curve, kd, 0.075, cost, 0.0, value) > 1)
    assert (block_saving(curve, kd, 0.075, cost, 0.0, value)
            > block_saving(lookup, kn, 1e-6, cost, 0.0, value) > 0)
    choice = policy.choose(Context(category="c", k_max=8, generated=10, remaining=40,
                                   live=live, costs=pair, proposers=("draft", "ngram"),
                                   matches={"ngram": (1,)}, gap=1))
    assert int(choice) == kd and getattr(choice, "proposer", "draft") == "draft"
    # where the lookup's block also saves more (a copy: its tokens hold), it takes the step
    for _ in range(200):
        live.observe_shadow("ngram", 1, 8, 8)
    choice = policy.choose(Context(category="c", k_max=8, generated=10, remaining=40,
                                   live=live, costs=pair, proposers=("draft", "ngram"),
                                   matches={"ngram": (1,)}, gap=1))
    assert getattr(choice, "proposer", "draft") == "ngram"


def _chat_like(first_every: int, catch_ups: bool):
    """(a category's statistics, the pair's costs): the draft's blocks hold 0.74 at T_d =
    75 ms, the n-gram's from a 1-token match hold 1 in ``first_every``; verification flat;
    with ``catch_ups``, the draft's catch-ups measured as on the default pair (3–4 tokens
    ~0.12 s, a 48-token prompt ~0.22 s)."""
    live, pair = LiveStats(discount=1.0), costs()
    for i in range(120):
        live.observe(1, (1, 1, 1, 0)[i % 4], 0.075, 0.229)
        pair.observe(1, 0.229, 0.075)
        live.observe_shadow("ngram", 1, int(i % first_every == 0), 1)
    pair.t_target = {n: 0.228 + 0.001 * (n - 1) for n in range(1, 18)}
    pair.t_draft, pair.t_lookup["ngram"] = 0.075, 1e-6
    live.spent = [0.15 * 400, 400]
    if catch_ups:
        for g, c in ((3, 0.12), (4, 0.125), (48, 0.22), (3, 0.115), (50, 0.23)):
            live.observe_catch_up(g, c)
            pair.observe_catch_up(g, c)
    return live, pair


def test_an_n_gram_block_is_charged_the_catch_up_it_causes_the_draft():
    _live, pair = _chat_like(3, catch_ups=True)
    assert induced_catch_up(_chat_like(3, catch_ups=False)[1], 1, 2.0) == 0.0  # unmeasured
    # after a draft block (gap ≤ 2) the draft's next step becomes a catch-up over the block
    assert induced_catch_up(pair, 1, 2.0) == pytest.approx(pair.catch_up_cost(3) - 0.075)
    # already behind: only the tokens the block adds to the catch-up it owes anyway
    assert induced_catch_up(pair, 40, 2.0) == pytest.approx(
        pair.catch_up_cost(42) - pair.catch_up_cost(40))
    assert 0 < induced_catch_up(pair, 40, 2.0) < induced_catch_up(pair, 1, 2.0)

    def choose(stats):
        live, pair = stats
        return CostModelPolicy().choose(Context(
            category="c", k_max=8, generated=10, remaining=40, live=live, costs=pair,
            proposers=("draft", "ngram"), matches={"ngram": (1,)}, gap=1))

    # n-gram first tokens right 1 in 3: its block saves more than the draft's, less than
    # that once the draft's catch-up after it is counted
    assert getattr(choose(_chat_like(3, catch_ups=False)), "proposer", None) == "ngram"
    chosen = choose(_chat_like(3, catch_ups=True))
    assert int(chosen) > 0 and getattr(chosen, "proposer", "draft") == "draft"
    # 1 in 2: the lookup pays for the catch-up too
    assert getattr(choose(_chat_like(2, catch_ups=True)), "proposer", None) == "ngram"


def test_the_request_rate_decides_where_the_category_rate_would_not():
    """A copy-heavy category runs at a third of plain decoding's time per token, so the
    draft model's blocks are not worth it there; a request of it that has nothing to copy
    (it ran 40 tokens at the plain rate so far) drafts again. (S alone would draft both.)"""
    live, pair = _measured(1)
    live.spent = [0.035 * 400, 400]  # the category: 0.035 s per token, T_t(1) = 0.104
    pair.t_draft = 0.035  # a draft step a third of the target's, as the default pair on CPU
    ctx = dict(category="c", k_max=8, generated=40, remaining=200, live=live, costs=pair,
               proposers=("draft", "ngram"), matches={"ngram": (0,)}, gap=1)
    policy = CostModelPolicy()
    assert int(policy.choose(Context(**ctx))) == 0
    request = LiveStats(discount=1.0)
    request.spent = [0.104 * 40, 40]  # 40 tokens at the plain rate so far
    assert int(policy.choose(Context(**ctx, request=request))) > 0
    assert int(CostModelPolicy(proposers="draft").choose(Context(**ctx))) > 0  # one proposer


def test_a_request_whose_matches_fail_stops_trusting_its_categorys_n_gram():
    """A copy-heavy category (its n-gram blocks from a 2-token match hold 0.9 per position)
    and one of its requests whose n-gram blocks and shadow all failed at once: its n-gram
    curve falls toward its own evidence, it stops proposing n-gram blocks, and the draft's
    catch-up is shared over more of the request (its matches serve nothing)."""
    live, pair = _measured(5)
    pair.t_target = {n: 0.1 + 0.02 * n for n in range(1, 18)}  # verification not free
    request = LiveStats(discount=1.0)
    ctx = dict(category="c", k_max=8, generated=20, remaining=44, live=live, costs=pair,
               proposers=("draft", "ngram"), matches={"ngram": (2,)}, gap=1)
    cat_curve = live.curve("ngram", 8, match=2)
    assert request_curve(cat_curve, request, "ngram") == cat_curve
    choice = CostModelPolicy().choose(Context(**ctx, request=request))
    assert getattr(choice, "proposer", "draft") == "ngram" and int(choice) == 8
    for _ in range(10):
        request.observe_shadow("ngram", 2, 0, 1)  # proposed, and the first token was wrong
    curve = request_curve(cat_curve, request, "ngram")
    w = DEFAULTS.request_prior_blocks
    assert curve[0] == pytest.approx(cat_curve[0] * w / (w + 10))
    assert curve[1:] == cat_curve[1:]  # never reached in this request
    choice = CostModelPolicy().choose(Context(**ctx, request=request))
    assert getattr(choice, "proposer", "draft") == "draft"
    policy = CostModelPolicy()
    far = dict(ctx, gap=300)
    assert (policy._catch_up(Context(**far, request=request), [live], pair.t_draft,
                             ("draft", "ngram"))
            < policy._catch_up(Context(**far), [live], pair.t_draft, ("draft", "ngram")))


def test_a_catch_up_is_priced_only_past_the_usual_gap_and_once_measured():
    live = costs()
    live.t_draft = 0.02
    assert catch_up_per_token(live, 300, 10) == 0.0  # unmeasured
    live.observe_catch_up(300, 0.62)
    assert catch_up_per_token(live, 2, 10) == 0.0  # after a draft block: no catch-up
    assert catch_up_per_token(live, 300, 10) == pytest.approx((0.62 - 0.02) / 10)
    assert catch_up_per_token(live, 300, 0) == pytest.approx(0.60)  # at least one token


def _measured(match_every: int):
    """(a category's statistics, the pair's costs): costs like the default pair's on this CPU
    (T_t(1) 0.1 s, a draft step 0.02 s, a catch-up over a 300-token prompt 0.6 s), the
    draft's k = 3 blocks worth 1.48× caught up, and decision points of which one in
    ``match_every`` has no n-gram match (where one has, its blocks hold)."""
    live, pair = LiveStats(discount=1.0), costs()
    pair.t_target = {n: 0.1 + 0.004 * n for n in range(1, 18)}
    pair.t_draft, pair.t_lookup["ngram"] = 0.02, 1e-6
    for i in range(60):
        live.observe(3, (2, 1, 3, 0)[i % 4], 0.06, 0.116)
        pair.observe(3, 0.116, 0.06)
        live.observe_match(i % match_every != 0, proposer="ngram")
    for g, c in ((300, 0.6), (8, 0.03)):
        live.observe_catch_up(g, c)
        pair.observe_catch_up(g, c)
    for _ in range(40):  # where it has a match, the n-gram's blocks hold
        live.observe_shadow("ngram", 2, 8, 8)
    return live, pair


@pytest.mark.parametrize("gap, remaining, match_every, drafts", [
    (300, 60, 5, False),  # copy-heavy: the draft would serve ~14 tokens, not worth 0.6 s
    (1, 60, 5, True),  # the draft is caught up: nothing to pay
    (300, 2000, 5, True),  # a long request pays it back
    (300, 60, 1, True),  # no n-gram matches: the draft serves all 60
])
def test_the_cost_model_resumes_the_draft_only_where_its_catch_up_pays(
        gap, remaining, match_every, drafts):
    live, pair = _measured(match_every)
    policy = CostModelPolicy(stop_rule=False)  # the block as priced (its stop: test_stopping)
    ctx = Context(category="c", k_max=8, generated=4, remaining=remaining, live=live,
                  costs=pair, proposers=("draft", "ngram"), matches={"ngram": (0,)}, gap=gap)
    choice = policy.choose(ctx)
    assert (int(choice) > 0) == drafts, (int(choice), live.unmatched_share("ngram"))
    if drafts:  # and the k it drafts with serves tokens at the best rate, catch-up included
        first = live.curve("ngram", 1)[0]
        share = live.unmatched_share("ngram")
        served = remaining * (share + (1 - share) * (1 - first))
        curve, cost = live.curve("draft", 8), pair.cost(optimistic=True)
        per_token = catch_up_per_token(pair, gap, served)
        want, _s = best_k(curve, 0.02, cost, 8, per_token=per_token)
        assert int(choice) == want and getattr(choice, "proposer", "draft") == "draft"
        value = min(live.seconds_per_token(), pair.t_target[1])
        assert valued_speedup(curve, want, 0.02, cost, per_token, value) > 1


def test_the_draft_alone_charges_its_catch_up_to_the_whole_rest_of_the_request():
    live, pair = _measured(5)
    ctx = dict(category="c", k_max=8, generated=4, live=live, costs=pair,
               matches={"ngram": (0,)}, gap=300)
    policy = CostModelPolicy(proposers="draft")  # the n-gram is not this policy's option
    assert int(policy.choose(Context(**ctx, remaining=60, proposers=("draft", "ngram")))) > 0
    assert int(policy.choose(Context(**ctx, remaining=3, proposers=("draft", "ngram")))) == 0


def test_the_loop_reports_the_gap_and_measures_each_catch_up(slow_catch_up):  # noqa: F811
    """A policy that decodes 6 plain steps, then drafts 2 blocks, over and over: the draft's
    gap grows through each plain stretch (the prompt's 10 tokens at the start), is at most 2
    after a draft block, and every resumption feeds one catch-up of exactly that many tokens
    — slowed here, so the fitted cost says so."""

    class Gaps(Stretches):
        def __init__(self):
            super().__init__(k=3, off=6, on=2)
            self.gaps: list[int] = []
            self.requests: list = []

        def choose(self, ctx):
            self.gaps.append(ctx.gap)
            lookup = ctx.request.by_proposer.get("ngram")
            self.requests.append((tuple(ctx.request.spent),
                                  sum(lookup.match_points) if lookup else 0.0))
            return super().choose(ctx)

    target = tiny("llama", sharpen=30.0)
    policy = Gaps()
    spec = autospec.Controller(target, noisy_copy(target, 0.5), store=False, policy=policy)
    spec.generate(prompt(10), max_new_tokens=40, do_sample=False, eos_token_id=None,
                  category="c")
    ks = spec.last_stats.k_schedule
    gaps = policy.gaps[: len(ks)]
    assert gaps[:7] == [10, 11, 12, 13, 14, 15, 16]  # the prompt, then one more per step
    resumed = [g for i, g in enumerate(gaps) if ks[i] > 0 and (i == 0 or ks[i - 1] == 0)]
    after_block = [g for i, g in enumerate(gaps) if i and ks[i - 1] > 0]
    assert len(resumed) >= 3 and all(g > 2 for g in resumed)
    assert after_block and all(g <= 2 for g in after_block)
    live, pair = spec.live["c"], spec.costs.at("eager")
    weights = [0.98 ** (len(resumed) - 1 - i) for i in range(len(resumed))]
    assert pair.catch_up[0] == pytest.approx(sum(weights))
    assert pair.catch_up[1] == pytest.approx(sum(w * g for w, g in zip(weights, resumed)))
    assert pair.catch_up_cost(10) >= SLOW
    # the request's own account: tokens past prefill's, every decision point
    acc = spec.last_stats.accepted_schedule
    for i, ((seconds, tokens), points) in enumerate(policy.requests[: len(ks)]):
        assert points == i
        assert tokens == sum(a + 1 for a in acc[1:i])
        assert (seconds > 0) == (i > 1)
    assert policy.requests[len(ks) - 1][0][0] >= SLOW * (len(resumed) - 1)  # catch-ups in
    # the n-gram's match was looked at once per decision point (discounted as the counts)
    d = live.discount
    assert sum(live.by_proposer["ngram"].match_points) == pytest.approx((1 - d ** len(ks)) / (1 - d))
    spec.close()


