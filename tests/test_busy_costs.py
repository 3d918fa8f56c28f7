"""Costs a busy machine cannot fool (issue 32, item 5): the shape guard, the level tracked
from recent plain steps, scatter, and the re-measure when the level moves — driven with real
``LiveStats``, a real ``CostTable`` row and ``CostModelPolicy`` through timing sequences that
reproduce a busy start (a neighbour's burst on both cores while the first plain steps were
timed) and its end. The timings are given, never measured: nothing here depends on this
machine's speed."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from autospec.costs.measure import MEASURE
from autospec.costs.price import acceptance_cap, expected_tokens
from autospec.costs.rules import shape_guard, spread
from autospec.costs.stored import stored_costs
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy
from autospec.policies.live import LiveStats

from conftest import noisy_copy, tiny

SHAPE_FLOOR = MEASURE.shape_floor

T1 = 0.22  # the default pair's plain step on a quiet 2-core CPU, bf16 (docs/benchmarks.md)


def quiet_t(n: int) -> float:
    """T_t(n) on a quiet machine: 0.82 · T_t(1) at n = 2 (bf16 on this CPU kind), then
    growing 4 % per token (T_t(14) ≈ 0.34 s, the store's quiet point in the issue)."""
    return T1 * (0.82 if n == 2 else 1 + 0.04 * (n - 1))


def stats() -> tuple[LiveStats, object]:
    """A category's statistics and the pair's costs at batch 1 (a fresh table's row)."""
    return LiveStats(), CostTable().at("eager")


def run(live, costs, iterations: int, alpha, *, load=lambda it: 1.0, draft_load=None,
        t_draft: float = 0.07, seed: int = 0, jitter: float = 0.0, policy=None):
    """Decode ``iterations`` iterations with ``policy`` (the cost model) choosing k; each
    block accepts position i with ``alpha(i)`` (or a constant); the target's forward of n
    tokens takes quiet_t(n) × load(it), a draft step t_draft × draft_load(it) (default: the
    same load), fed to the category's ``live`` and the pair's ``costs`` as the accounting
    feeds them. Returns the k chosen per iteration."""
    policy = policy or CostModelPolicy()
    rng, noise = random.Random(seed), random.Random(seed + 1)
    ks = []
    for it in range(iterations):
        choice = policy.choose(Context(category="chat", k_max=16, live=live, costs=costs,
                                       remaining=500))
        stop = getattr(choice, "stop", None)  # a draft that reads no confidence: at α
        k = int(choice) if stop is None else stop.unread(int(choice))
        m = 0
        while m < k and rng.random() < (alpha(m) if callable(alpha) else alpha):
            m += 1
        j = noise.uniform(1 - jitter, 1 + jitter)
        f = load(it)
        fd = draft_load(it) if draft_load is not None else f
        live.observe(k, m, fd * t_draft * k * j, f * quiet_t(k + 1) * j)
        costs.observe(k, f * quiet_t(k + 1) * j, fd * t_draft * k * j)
        ks.append(k)
    return ks


def tail(m: int) -> float:
    """Low first-position acceptance with a long tail (blocks of 13 accept ~0.13 of their
    tokens): long blocks look worth it wherever verification looks free."""
    return 0.3 if m == 0 else 0.8


def test_a_burst_during_the_first_plain_steps_does_not_buy_long_blocks():
    """The plain steps that settle T_t(1) ran in a burst (×6: 1.3 s), every block after in a
    quiet moment. Before the guard: T_t(1) = 1.32 s was never re-measured while drafting,
    every block looked nearly free against it, and k climbed to 8 at acceptance ~0.2."""
    for seed in range(3):
        live, costs = stats()
        ks = run(live, costs, 80, tail, load=lambda it: 6.0 if it < 5 else 1.0, seed=seed)
        assert max(ks) < 8, ks
        assert costs.t_target[1] == pytest.approx(T1, rel=0.05)  # the level was re-measured
        assert costs.held_out >= 1
        curve = costs.cost()
        assert all(curve(n) >= SHAPE_FLOOR * curve(1) for n in range(2, 17))


def test_a_stored_impossible_curve_is_held_out_at_warm_start():
    """The store a busy run left: T_t(1) = 1329 ms (a burst) but T_t(14) = 338 ms. Read
    back, such a curve sent the next process to k = 6…9 at acceptance ~0.2; guarded, the
    impossible points are measured again and the level with them."""
    history = [0.3 * 0.8 ** i for i in range(16)]  # cumulative rates of the tail above
    bad = {1: 1.329, 2: 1.1, 4: 0.9, 14: 0.338}
    live, costs = stats()
    live.warm_start({"draft": ([50 * h for h in history], [50.0] * 16)}, weight=50)
    costs.warm(t_target=bad, t_draft=0.07)
    assert sorted(costs.t_target) == [1, 2]  # 0.9 and 0.338 are below 0.7 × 1.329
    assert all(t >= SHAPE_FLOOR * costs.t_target[1] for t in costs.t_target.values())
    ks = run(live, costs, 60, tail)
    assert max(ks) < 8, ks
    # a probe timed every n back to back: its curve is trusted as it is
    probed = CostTable().at("eager")
    probed.warm(t_target={1: 0.2, 2: 0.12, 4: 0.13}, t_draft=0.02, probe=True)
    assert probed.t_target == {1: 0.2, 2: 0.12, 4: 0.13}
    assert probed.cost()(2) == pytest.approx(0.12)
    assert shape_guard(bad) == {1: 1.329, 2: 1.1}


def test_a_busy_machine_bounds_k_by_acceptance():
    """Timings that scatter (a burst every other plain step) make the machine busy; then k
    stays within what the acceptance alone justifies (α = 0.13: k = 1), whatever the
    costs say."""
    live, costs = stats()
    live.warm_start({"draft": ([200 * 0.13 ** (i + 1) for i in range(16)], [200.0] * 16)},
                    weight=200)
    costs.warm(t_target={1: 1.0, 2: 1.0, 17: 1.0}, t_draft=0.001)  # flat and free
    policy = CostModelPolicy()
    ctx = Context(category="chat", k_max=16, live=live, costs=costs, remaining=500)
    quiet = policy.choose(ctx)  # quiet costs this cheap buy longer blocks: 3 tokens, where
    assert quiet.stop.unread(int(quiet)) == 3  # the next stops paying (at α, no confidence)
    for t in (1.0, 3.0, 1.0, 3.0):
        live.observe(0, 0, 0.0, t)
        costs.observe(0, t)
    assert costs.busy()
    assert 0 < policy.choose(ctx) <= acceptance_cap(live.curve("draft", 16), 16) == 1
    assert acceptance_cap(0.5, 16) == 3 and acceptance_cap(0.8, 16) == 10
    assert expected_tokens(0.13, 1) > 1


def test_speculation_comes_back_soon_after_a_burst_ends():
    """A neighbour busy on both cores for the first 40 iterations (target ×3, the draft
    ×10): the draft model is priced out and decoding is plain. When the machine is quiet
    again the plain steps are fast, the level moves, and T_d, carried over the move, counts
    as unmeasured: the draft model's block is explored at once and T_d re-measured — before
    the guard, the re-probe waited 64 off steps and more (stretched by the busy costs), and
    none came within these requests."""
    for seed in range(3):
        live, costs = stats()
        ks = run(live, costs, 120, 0.7, load=lambda it: 3.0 if it < 40 else 1.0,
                 draft_load=lambda it: 10.0 if it < 40 else 1.0, seed=seed)
        assert not any(ks[10:40])  # priced out while busy
        back = next(i for i in range(40, 120) if ks[i] > 0)
        assert back - 40 <= 8, ks
        assert sum(k > 0 for k in ks[60:]) >= 50  # and it stays on where it pays
        assert costs.level_moves >= 1
        assert costs.t_draft == pytest.approx(0.07, rel=0.1)  # re-measured, not carried


@pytest.mark.parametrize("alpha,t_draft", [(0.7, 0.07), (0.3, 0.07), (0.9, 0.02)])
def test_quiet_consistent_timings_decide_as_without_the_guard(alpha, t_draft):
    """On quiet timings (±3 % noise) the guard changes no decision: the same run with the
    guard switched off (no scatter, no level move, no shape floor) chooses the same k at
    every iteration."""
    off = MEASURE.but(scatter=1e9, level_move=1e9, shape_floor=0.0)
    runs = []
    for measure in (MEASURE, off):
        live, costs = LiveStats(), CostTable(measure=measure).at("eager")
        runs.append(run(live, costs, 80, alpha, t_draft=t_draft, jitter=0.03))
        assert not costs.busy() and costs.held_out == 0 and costs.level_moves == 0
    assert runs[0] == runs[1] and any(runs[0])


def test_spread_reads_bursts_not_single_outliers():
    assert spread([0.22, 0.23, 0.21, 0.22, 0.5]) < 0.2  # one slow forward
    assert spread([1.3, 0.3, 0.3]) > 0.2  # a burst and its end
    assert spread([0.2, 0.2]) == 0.0  # too few to tell


@pytest.fixture
def models():
    target = tiny("llama", sharpen=30.0)
    return target, noisy_copy(target, 0.2)


def test_a_warm_start_from_a_bad_live_store_is_guarded(models, tmp_path):
    """End to end: a store whose live timings of this path hold a burst's T_t(1) beside
    quiet long blocks; a new controller warms from it without the impossible points, and
    ``stored_costs`` (every reader's) says what it held out. A probe
    of the same path is read as it is."""
    from test_costs_path import record

    import autospec
    from autospec.store import add_probe, open_store, queries
    from autospec.telemetry import RequestTelemetry

    url = f"sqlite:///{tmp_path / 'busy.db'}"
    pinfo = RequestTelemetry(*models, measure_peak=False).pair
    bad = {1: 1.329, 2: 1.1, 4: 0.9, 14: 0.338}
    with open_store(url) as store:
        store.write([record("eager", bad, 0.05, forwards=16, category="default", pair=pinfo)
                     for _ in range(2)])
        with store.session() as s:
            pid = queries.pair_id(s, pinfo)
            c = stored_costs(s, pid, "default", path="eager")
            curve, source = c.t_target, c.source
        assert curve == pytest.approx({1: 1.329, 2: 1.1}) and "held out" in source
    spec = autospec.Controller(*models, store=url, policy="auto")
    spec.live_stats("default")
    spec.close()
    assert sorted(spec.costs.at("eager").t_target) == [1, 2]
    probe = {1: 0.2, 2: 0.12, 4: 0.13}
    with open_store(url) as store:
        with store.session() as s:
            add_probe(s, pinfo, {"target_s_by_n": probe, "draft_s": 0.02, "path": "eager"})
            s.commit()
    spec = autospec.Controller(*models, store=url, policy="auto")
    spec.live_stats("default")
    spec.close()
    assert spec.costs.at("eager").t_target == pytest.approx(probe)


def test_batch_costs_hold_out_a_shape_no_machine_shows():
    """The guard at B > 1: T_t(4, 1) settled during a burst (×3), then a quiet block of 5
    tokens at a third of it is held out, not taken for the curve's shape; a floor above it
    keeps it."""
    for floor, held in ((SHAPE_FLOOR, True), (0.2, False)):
        table = CostTable(measure=MEASURE.but(shape_floor=floor))
        costs = table.at("eager", 4)
        for _ in range(3):
            costs.observe(0, 3 * 0.3)
        costs.observe(4, 0.33, 4 * 0.02)
        assert costs.held_out == int(held)
        assert (5 in table.snapshot("eager")[0][4]) == (not held)
        cost = table.target_cost("eager", 4)
        assert all(cost(n) >= floor * cost(1) - 1e-12 for n in range(2, 9))


def test_busy_reads_what_the_recent_timings_say_every_iteration():
    """``busy`` remembers each n's verdict while no sample came: at every iteration of a run
    with bursts, level moves and samples ageing out of the window, it says what the recent
    timings, read afresh (the quartiles as ``statistics`` computes them), say."""
    import statistics

    def fresh(ls) -> bool:
        it = ls.iterations
        if it < ls._busy_until:
            return True
        for samples in ls._recent.values():
            xs = [t for i, t in samples if i >= it - MEASURE.scatter_window]
            if len(xs) >= 3:
                q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
                if (q3 - q1) / q2 > MEASURE.scatter:
                    return True
        return False

    rng = random.Random(7)
    ls = CostTable().at("eager")
    verdicts = set()
    for it in range(600):
        k = rng.choice([0, 0, 0, 1, 3, 4, 7]) if it % 200 < 120 else 0
        burst = 3.0 if 250 <= it < 270 or rng.random() < 0.03 else 1.0
        rng.randint(0, k)  # the accepted count (no timing): the same random sequence
        ls.observe(k, burst * 0.01 * (1 + 0.1 * k) * rng.uniform(0.97, 1.03), 0.001 * k)
        got = ls.busy()
        assert got == fresh(ls), it
        verdicts.add(got)
    assert verdicts == {True, False}


def test_a_draft_cost_carried_over_a_level_move_still_prices_the_drafts_block():
    """After a level move T_d is carried (scaled to the new level) until the draft runs
    again. The draft's block is still priced at the carried T_d — it competes as before — and
    only where it is not the choice does exploration re-time T_d with a one-token block
    (treating a carried T_d as unmeasured dropped the draft's block, and prompt lookup's
    chance matches won where the draft model should have run)."""
    live, costs = stats()
    live.warm_start({"draft": ([160 * 0.8 ** (i + 1) for i in range(16)], [160.0] * 16)},
                    weight=160)
    costs.warm(t_target={n: quiet_t(n) for n in range(1, 18)}, t_draft=0.05, probe=True)
    ctx = Context(category="chat", k_max=16, live=live, costs=costs, remaining=500)
    why: list = []
    before = CostModelPolicy(stop_rule=False).choose(ctx)
    costs._stale.add(0)  # the guard's state after a level move: T_d carried, not re-timed
    assert costs.carried() and costs.known()
    after = CostModelPolicy(stop_rule=False).choose(replace(ctx, why=why))
    assert int(after) == int(before) > 1 and why[-1]["rule"] == "best"
    # where the carried T_d prices the draft out, exploration re-times it: one token, T_d free
    live2, costs2 = stats()
    live2.warm_start({"draft": ([160 * 0.8 ** (i + 1) for i in range(16)], [160.0] * 16)},
                     weight=160)
    costs2.warm(t_target={n: quiet_t(n) for n in range(1, 18)}, t_draft=0.5, probe=True)
    why2: list = []
    ctx2 = Context(category="chat", k_max=16, live=live2, costs=costs2, remaining=500, why=why2)
    assert CostModelPolicy().choose(ctx2) == 0
    costs2._stale.add(0)
    assert CostModelPolicy().choose(ctx2) == 1 and why2[-1]["rule"] == "explore"
