from __future__ import annotations

import math

import pytest

from autospec.costs.measure import MEASURE
from autospec.costs.price import best_k, expected_tokens, interpolate_cost, speedup


def costs():
    """The pair's costs at batch 1 on one path (a fresh table's row)."""
    from autospec.costs.table import CostTable

    return CostTable().at("eager")


def feed(live, pair, k: int, m: int, draft_s: float, target_s: float) -> None:
    """One iteration into the category's statistics and the pair's costs, as accounted."""
    live.observe(k, m, draft_s, target_s)
    pair.observe(k, target_s, draft_s)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_expected_tokens_closed_form_for_constant_alpha(alpha, k):
    closed = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    assert math.isclose(expected_tokens(alpha, k), closed, rel_tol=1e-12)


def derived(policy, live, pair, top: int):
    """(the draft model's curve, T_t as a function) the policy derived from ``live`` and the
    pair's costs."""
    return policy.derived(live, "draft", top), policy.derived_cost(pair)


def test_per_position_acceptance_multiplies():
    assert math.isclose(expected_tokens([0.9, 0.5, 0.1], 3), 1 + 0.9 + 0.45 + 0.045)
    assert math.isclose(expected_tokens([0.9, None], 3), 1 + 0.9 + 0.81 + 0.729)


def test_interpolation_is_linear_inside_and_never_decreases_outside():
    cost = interpolate_cost({1: 1.0, 5: 2.0})
    assert cost(3) == 1.5 and cost(1) == 1.0 and cost(9) == 3.0
    assert interpolate_cost({2: 1.0})(8) == 1.0


def test_optimism_stays_within_the_noise_and_reads_a_real_rise_as_real():
    # flat within the noise (fp32 on a memory-bound CPU, one slow sample at n = 2): the
    # cheapest consistent cost, flat beyond the last point, as before
    flat = interpolate_cost({1: 1.0, 2: 1.2}, optimistic=True)
    assert flat(2) == flat(16) == 1.2 and flat(1) == 1.0
    step = interpolate_cost({1: 1.0, 8: 1.2}, optimistic=True)
    assert step(4) == step(7) == 1.0  # a step within the noise is still explored
    # compute-bound (bf16 on a CPU without AVX-512): the rise is real
    bound = interpolate_cost({1: 0.25, 4: 0.85}, optimistic=True)
    slope = (0.85 - 0.25 - MEASURE.cost_noise * 0.25) / 3
    assert bound(16) == pytest.approx(0.85 + 12 * slope)
    assert bound(1) == bound(2) == bound(3) == 0.25  # the rise may start anywhere up to 4
    assert bound(4) == 0.85
    # between measured points: a neighbouring segment continued, less the noise, never
    # below the lower point nor above the chord
    mid = interpolate_cost({1: 0.25, 4: 0.85, 16: 3.25}, optimistic=True)
    assert mid(10) == pytest.approx(2.05 - MEASURE.cost_noise * 0.25) and mid(5) == pytest.approx(1.05 - MEASURE.cost_noise * 0.25)
    # a step behind flat points stays hidden only until it is measured (fp32, old CPU)
    assert interpolate_cost({1: 1.0, 2: 1.0, 4: 2.0}, optimistic=True)(3) == 1.0
    assert interpolate_cost({1: 1.0, 2: 1.5, 4: 2.0}, optimistic=True)(3) == 1.75
    linear = interpolate_cost({1: 0.25, 4: 0.85, 16: 3.25})
    for n in range(1, 24):  # optimism is never dearer than the linear reading
        assert mid(n) <= linear(n) + 1e-12 and mid(n) <= mid(n + 1)


def test_a_cold_policy_on_compute_bound_verification_tries_each_short_block_once_then_stops():
    """The cold run on a CPU without AVX-512 (bf16: T_t(4) = 3.2 T_t(1)): the optimistic
    reading took T_t(16) for T_t(4) and each unmeasured n for the measured one below it, so
    the draft model, accepted in full, was tried at k = 15, 11 and 10 before it stopped.
    Here nothing pays even at perfect acceptance; the policy measures plain, its initial
    k, each shorter block the points still allow, once, and stops."""
    from autospec.policies import Context, CostModelPolicy
    from autospec.policies.live import LiveStats

    def t_target(n):
        return 0.05 + 0.2 * n

    t_draft = 0.1
    assert best_k(1.0, t_draft, {n: t_target(n) for n in range(1, 18)}, 16)[0] == 0
    live, pair, policy = LiveStats(), costs(), CostModelPolicy(initial_k=3)
    ks = []
    for _ in range(40):
        k = policy.choose(Context(category="code", k_max=16, live=live, costs=pair,
                                  remaining=200))
        ks.append(k)
        feed(live, pair, k, k, t_draft * k, t_target(k + 1))  # every draft accepted
    assert [k for k in ks if k] == [3, 2]
    assert ks[0] == 0 and ks[-30:] == [0] * 30


def test_memory_bound_pays_compute_bound_does_not():
    # flat verification cost (memory bound), cheap draft, good acceptance → speculate
    k, s = best_k(0.8, 0.05, {1: 1.0, 16: 1.05}, 8)
    assert k >= 3 and s > 2
    # verification cost linear in tokens (compute bound): k = 0 wins
    k, s = best_k(0.8, 0.05, {1: 1.0, 16: 16.0}, 8)
    assert (k, s) == (0, 1.0)
    # acceptance below the draft's relative cost c: never pays even when memory bound
    assert best_k(0.2, 0.3, {1: 1.0, 16: 1.0}, 8)[0] == 0


def test_speedup_matches_definition():
    s = speedup(3, 0.5, 0.1, {1: 1.0, 4: 1.2})
    assert math.isclose(s, (1 + 0.5 + 0.25 + 0.125) * 1.0 / (0.3 + 1.2))


class _Counting:
    """Counts how often the curves (and cost functions) a policy decides by are built."""

    builds = 0

    @classmethod
    def stats(cls):
        from autospec.policies.live import LiveStats

        class Counting(LiveStats):
            def curve(self, proposer, k_max, *, match=0):
                cls.builds += 1
                return super().curve(proposer, k_max, match=match)

        return Counting()

    @classmethod
    def costs(cls):
        pair = costs()
        build = pair.cost

        def counted(optimistic=False):
            cls.builds += 1
            return build(optimistic)

        pair.cost = counted
        return pair


def test_the_policy_rebuilds_its_curves_only_when_the_statistics_change():
    from autospec.policies import Context, CostModelPolicy
    from autospec.policies.live import LiveStats

    live, pair = _Counting.stats(), _Counting.costs()
    for k, m in [(3, 2), (3, 3), (0, 0), (2, 1), (4, 1)]:
        feed(live, pair, k, m, 0.002 * k, 0.01 + 0.001 * k)
    pol = CostModelPolicy()
    ctx = Context(k_max=8, live=live, costs=pair, remaining=100)
    k1 = pol.choose(ctx)
    curve, cost = derived(pol, live, pair, 8)
    built = _Counting.builds
    assert pol.choose(ctx) == k1 and _Counting.builds == built  # unchanged: nothing rebuilt
    assert derived(pol, live, pair, 8) == (curve, cost)
    assert derived(pol, live, pair, 8)[0] is curve and derived(pol, live, pair, 8)[1] is cost
    feed(live, pair, 3, 0, 0.006, 0.013)  # a new version: rebuilt, from the new statistics
    new_curve, new_cost = derived(pol, live, pair, 8)
    assert _Counting.builds == built + 2 and new_curve is not curve and new_cost is not cost
    assert new_curve == LiveStats.curve(live, "draft", 8) and new_curve != curve
    assert new_cost(4) == pair.cost(optimistic=True)(4)
    assert derived(pol, live, pair, 5)[0] == LiveStats.curve(live, "draft", 5)  # its length


def test_a_policy_with_derived_curves_copies_and_pickles():
    import copy
    import pickle

    from autospec.policies import Context, CostModelPolicy
    from autospec.policies.live import LiveStats

    live, pair = LiveStats(), costs()
    for k, m in [(3, 2), (0, 0), (2, 1)]:
        feed(live, pair, k, m, 0.002 * k, 0.01 + 0.001 * k)
    pol = CostModelPolicy(min_gain=0.05)
    k = pol.choose(Context(k_max=8, live=live, costs=pair, remaining=100))
    for twin in (copy.deepcopy(pol), pickle.loads(pickle.dumps(pol))):
        assert twin.params.min_gain == 0.05
        assert twin.choose(Context(k_max=8, live=live, costs=pair, remaining=100)) == k


def test_a_live_cost_is_decided_by_once_three_samples_settle_it():
    """The first decode step after prefill runs slow (0.285 s where the next 30 took 0.22 s
    on the default pair); taken alone as T_t(1) it made k = 1 look paying for a request."""
    from autospec.costs.table import CostTable
    from autospec.policies import Context, CostModelPolicy
    from autospec.policies.live import LiveStats

    table = CostTable()
    live, pair, policy = LiveStats(), table.at("eager"), CostModelPolicy()
    ctx = Context(category="code", k_max=8, live=live, costs=pair, remaining=100)
    ks = []
    for t in (0.285, 0.22, 0.23):
        assert not pair.settled(1)
        ks.append(policy.choose(ctx))
        feed(live, pair, 0, 0, 0.0, t)
    assert ks == [0] * MEASURE.cost_settle and pair.settled(1)
    assert pair.t_target[1] == 0.23  # the median of the first samples, the slow one out
    feed(live, pair, 0, 0, 0.0, 0.2)  # then the moving average
    assert pair.t_target[1] == pytest.approx(0.8 * 0.23 + 0.2 * 0.2)
    assert table.copy().at("eager").settled(1)
    # a cost warm-started from the store, a probe or a peer category is settled at once
    warm = costs()
    warm.warm(t_target={1: 0.2, 4: 0.3}, t_draft=0.05)
    assert warm.settled(1) and warm.settled(4) and not warm.settled(2)
    warm.observe(0, 0.3)
    assert warm.t_target[1] == pytest.approx(0.8 * 0.2 + 0.2 * 0.3)
    assert policy.choose(Context(category="c", k_max=8, live=LiveStats(), costs=warm,
                                 remaining=100)) > 0


def test_derived_values_follow_what_they_are_derived_from():
    """The policy's cached curve and cost function: a lookup block (timings and lookup counts
    change, the draft model's counts do not) keeps the draft curve object and rebuilds the
    cost; a draft block rebuilds both; a lookup curve follows the lookups' counts alone.
    Every value read equals one computed afresh."""
    from autospec.policies.costmodel import CostModelPolicy
    from autospec.policies.live import LiveStats

    policy, live, pair = CostModelPolicy(), LiveStats(), costs()
    for k in (0, 0, 0, 3, 3):
        feed(live, pair, k, 2 if k else 0, 0.004 * k, 0.02 + 0.001 * k)
    live.observe_lookup("ngram", 4, 3, 0.0001, 0.025, match=2)
    pair.observe(4, 0.025, lookups={"ngram": 0.0001 / 4})
    curve, cost = derived(policy, live, pair, 8)
    ngram = policy.derived(live, "ngram", 8, 2)

    live.observe_lookup("ngram", 6, 1, 0.0001, 0.03, match=2)  # a lookup block: n = 7 timed
    pair.observe(6, 0.03, lookups={"ngram": 0.0001 / 6})
    curve2, cost2 = derived(policy, live, pair, 8)
    assert curve2 is curve and cost2 is not cost and cost2(7) == pair.cost()(7)
    ngram2 = policy.derived(live, "ngram", 8, 2)
    assert ngram2 is not ngram
    assert ngram2 == live.curve("ngram", 8, match=2)

    feed(live, pair, 3, 0, 0.012, 0.024)  # a draft block: counts and timings
    curve3, _ = derived(policy, live, pair, 8)
    assert curve3 is not curve and curve3 == live.curve("draft", 8)
    assert policy.derived(live, "ngram", 8, 2) is ngram2  # the lookups' counts did not move
    assert derived(policy, live, pair, 4)[0] == live.curve("draft", 4)
