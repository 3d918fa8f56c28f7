"""One cost table per controller (issue 48, item 3): every cost keyed by (execution path,
batch size), batch 1 its B = 1 row, the busy guard and each proposer's own propose time per
B, the one-row tail of a batched call on its own path's row. Real tiny models and SQLite
stores where a controller runs; elsewhere timings are given, never measured."""

from __future__ import annotations

import pytest
from test_batch_policy import batch_context, warm_stats

import autospec
from autospec.costs.price import acceptance_cap
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy, FixedK, LiveStats

from conftest import noisy_copy, prompt, tiny
from test_batch_exact import batch


def test_a_batched_calls_one_row_tail_keeps_off_the_static_paths_batch_1_curve():
    """With ``static_cache=True`` a batch-1 request runs static, a batched call eager — its
    one-row tail too. The tail's timings go to the eager path's batch-1 row; the static
    path's curve is untouched (before, the tail was accounted as batch 1 of the controller's
    one path and its eager timings entered the static curve)."""
    target = tiny("llama", layers=2, seed=0, sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.5), store=False, static_cache=True,
                               cuda_graphs=False, policy=FixedK(2))
    spec.generate(prompt(10), max_new_tokens=16, do_sample=False, eos_token_id=None,
                  category="c")
    assert spec.last_stats.path == "static"
    static = spec.costs.at("static")
    before = (dict(static.t_target), static.t_draft, static.iterations)
    assert before[0] and before[1]
    ids, mask = batch([6, 9, 7], seed=4)
    spec.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                  eos_token_id=None, category="c")
    assert spec.last_stats.path == "eager"
    tail = spec.costs.at("eager", 1)
    assert tail.iterations > 0 and tail.t_target  # a row ran alone at the end, timed here
    assert (dict(static.t_target), static.t_draft, static.iterations) == before
    assert {(row.path, row.batch) for row in spec.costs.rows()} >= {
        ("static", 1), ("eager", 1), ("eager", 3)}
    spec.close()


def test_a_timing_of_one_path_never_enters_another_paths_row_or_fit():
    table = CostTable()
    static, eager = table.at("static"), table.at("eager")
    for _ in range(3):
        static.observe(0, 0.1)
    static.observe(3, 0.2, 0.03)
    static.observe_catch_up(40, 0.08)
    assert static.t_target == {1: 0.1, 4: 0.2} and static.catch_up[0] == 1
    assert eager.t_target == {} and eager.t_draft is None and eager.catch_up[0] == 0
    assert table.target_cost("eager", 4) is None and table.draft_cost("eager", 1) is None
    assert table.at("static", 4).catch_up is static.catch_up  # one fit per path, every B


def test_the_busy_guard_bounds_k_at_batch_above_1():
    """Timings at B = 4 that scatter (a burst every other plain step) make that row busy;
    then the batch's k stays within what acceptance alone justifies (α = 0.13: k = 1),
    whatever the grid says — as at batch 1 (before, the guard was off at B > 1)."""
    table = CostTable(live=False)  # the grid is read as it is: flat and free
    table.warm_grid("eager", {4: {1: 1.0, 2: 1.0, 17: 1.0}}, {4: 0.001})
    stats = warm_stats(0.13)
    policy = CostModelPolicy()
    ctx = batch_context(stats, 4, table, remaining=500)
    assert int(policy.choose(ctx)) > 1  # quiet costs this cheap buy longer blocks
    row = table.at("eager", 4)
    for t in (1.0, 3.0, 1.0, 3.0):
        row.observe(0, t)
    assert row.busy() and not table.at("eager", 1).busy()
    assert 0 < int(policy.choose(ctx)) <= acceptance_cap(stats.curve("draft", 16), 16) == 1


def test_each_lookups_time_is_read_at_the_batch_size_that_measured_it():
    """A lookup proposer's seconds per proposed token are kept per batch size: a batch of 4
    prices prompt lookup at its own host time once it measured one (a batch's lookup serves
    every row), at the nearest batch size's until then."""
    table = CostTable()
    one, four = table.at("eager", 1), table.at("eager", 4)
    one.observe(3, 0.1, lookups={"ngram": 1e-5})
    assert four.lookup_cost("ngram") == 1e-5 and four.lookup_cost("suffix") is None
    four.observe(3, 0.2, lookups={"ngram": 4e-5})
    assert four.lookup_cost("ngram") == 4e-5 and one.lookup_cost("ngram") == 1e-5
    assert table.at("eager", 16).lookup_cost("ngram") == 4e-5  # the nearest: B = 4


def test_a_static_controller_warms_the_batched_paths_batch_1_row_from_its_own_costs(tmp_path):
    """The store keeps batch 1's costs per path: a static-cache controller warms its own path
    from the static ones, and, at its first batched call, the eager path's batch-1 row (where
    a batched call's tail runs) from the eager ones — never one from the other."""
    from test_costs_path import EAGER, STATIC, record

    from autospec.store import open_store
    from autospec.telemetry import RequestTelemetry

    target = tiny("qwen2", sharpen=30.0)
    draft = noisy_copy(target, 0.15)
    url = f"sqlite:///{tmp_path / 'paths.db'}"
    pinfo = RequestTelemetry(target, draft, measure_peak=False).pair
    with open_store(url) as store:
        store.write([record("eager", EAGER, 0.001, forwards=16, category="default",
                            pair=pinfo) for _ in range(2)]
                    + [record("static", STATIC, 0.02, forwards=16, category="default",
                              pair=pinfo) for _ in range(2)])
    spec = autospec.Controller(target, draft, store=url, policy="auto", static_cache=True,
                               cuda_graphs=False)
    try:
        spec.live_stats("default")
        assert spec.costs.at("static").t_target == pytest.approx(STATIC)
        assert spec.costs.at("eager").t_target == {}  # not read before a batched call
        ids, mask = batch([6, 9], seed=1)  # one token each: both rows end together, untimed
        spec.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                      eos_token_id=None, category="default")
        assert spec.last_stats.path == "eager"
        eager = spec.costs.at("eager")
        assert eager.costs_from == "store" and eager.t_target == pytest.approx(EAGER)
        assert eager.t_draft == pytest.approx(0.001)
        assert spec.costs.at("static").t_target == pytest.approx(STATIC)
        assert spec.costs.at("static").t_draft == pytest.approx(0.02)
    finally:
        spec.close()


def test_categories_share_the_table_and_hold_none_of_it():
    """Acceptance is the category's, every cost the pair's: a new category's decision reads
    what another category's requests measured, through the one table."""
    table = CostTable()
    costs = table.at("eager")
    for _ in range(3):
        costs.observe(0, 0.1)
    costs.observe(2, 0.1, 0.02)
    fresh = LiveStats()
    why: list = []
    CostModelPolicy().choose(Context(category="new", k_max=8, live=fresh, costs=costs,
                                     remaining=50, why=why))
    assert why[0]["rule"] != "baseline" and why[0]["t_plain"] == 0.1
    assert not hasattr(fresh, "costs") and fresh.version == 0  # nothing of it was fed
