"""Costs are the pair's, once (issue 32, item 4; issue 48, item 3): one ``CostTable`` per
controller whose rows are keyed by (execution path, batch size), shared by every category — a
category's timings are every category's, a burst one category's forwards show marks the
machine busy for all, a new category starts from what the process measured — and in the
store one ``pair_costs`` row per (pair, path), into which 0010 moved what ``category_costs``
held per category."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from sqlalchemy import MetaData, create_engine, insert, inspect, select
from test_ngram import _repetitive
from test_store_batch import _create_at, _downgrade, _insert_legacy, _legacy_stats

import autospec
from autospec.costs.measure import MEASURE
from autospec.costs.stored import stored_costs
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy, FixedK
from autospec.policies.live import LiveStats, copy_lives
from autospec.store import open_store, queries
from autospec.store.migrate import current_revision, head_revision
from autospec.store.tables import CategoryPath, PairCost
from autospec.store.write import category_key, validate_record

from conftest import noisy_copy, tiny
from test_store import BACKENDS, PAIRS, fresh_url, make_record


# -- in process ---------------------------------------------------------------------------------
def test_two_categories_of_a_controller_share_one_cost_object():
    """Category b's first decision prices with the timings category a measured: the pair's
    costs ("live"), not a "shared" copy; b's acceptance is its own, started from a's at
    cold_start blocks' weight (``LiveStats.seed_from``)."""
    target = tiny("llama", layers=2, seed=5)
    spec = autospec.Controller(target, noisy_copy(target, 0.1), store=False, policy="auto")
    ids = _repetitive(0)
    spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                  do_sample=False, category="a")
    costs = spec.costs.at("eager")
    assert 1 in costs.t_target and costs.t_draft and costs.settled(1)
    t_plain = costs.t_target[1]
    b = spec.live_stats("b")
    a = spec.live["a"]
    assert 0 < b.observed("draft") <= min(8.0, a.observed("draft"))  # seeded, not shared
    assert b.by_proposer["draft"] is not a.by_proposer["draft"]
    why = []
    CostModelPolicy().choose(Context(category="b", k_max=8, live=b, costs=costs,
                                     remaining=30, why=why))
    (record,) = why
    assert record["t_plain"] == t_plain  # a's T_t(1), settled: no plain step re-measures it
    assert record["rule"] != "baseline"
    assert {c["costs_from"] for c in record["candidates"]} == {"live"}  # not "shared"
    spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                  do_sample=False, category="b", explain=True)
    first = spec.last_stats.decisions[0]
    assert first["rule"] != "baseline" and first["candidates"][0]["costs_from"] == "live"
    # b's forwards fed the pair's costs: a's decisions read them (one clock, one curve)
    assert spec.costs.rows() == [costs] and costs.iterations > 0
    spec.close()


def test_a_burst_one_category_sees_marks_the_machine_busy_for_all():
    """Categories a and b of one controller read one row (its path at batch 1): what a's
    forwards show, b's decisions see."""
    table = CostTable()
    a, b = table.at("eager"), table.at("eager")  # what category a feeds, what b reads
    assert a is b
    for _ in range(MEASURE.cost_settle):
        a.observe(0, 0.1)  # the level: T_t(1) = 0.1 s
    a.observe(3, 0.12, 0.004)  # T_t(4), measured against that level
    assert not a.busy() and not b.busy()
    version = b.version
    a.observe(3, 0.1 * MEASURE.shape_floor / 2, 0.004)  # T_t(4) far below the level
    assert b.busy() and b.held_out == 1 and not b.settled(1)  # b re-measures the level too
    assert b.version > version  # b's cached decisions are rebuilt
    # a level move one category's plain steps show is every category's
    for _ in range(MEASURE.level_run + MEASURE.cost_settle):
        b.observe(0, 0.1 * MEASURE.level_move * 1.5)
    assert a.level_moves == b.level_moves >= 1


def test_statistics_hold_no_costs_and_replays_copy_the_table_once():
    """A category's statistics (and a copy of them) hold acceptance alone:
    feeding them feeds no cost. A replay that must not feed a controller's costs copies its
    table, once, for every category."""
    table = CostTable()
    costs = table.at("eager")
    for _ in range(MEASURE.cost_settle):
        costs.observe(0, 0.1)
    live = LiveStats()
    own = live.copy()  # a copy (replay's, a request's)
    costs.observe(2, 0.12, 0.02)  # the loop feeds the pair's row: every reader reads it
    assert costs.t_target[3] == 0.12 and costs.t_draft == 0.01
    ticks = costs.iterations
    own.observe(2, 1, 0.5, 9.0)  # the copy's feed: acceptance only, no second timing
    live.observe(2, 1, 0.5, 9.0)
    assert costs.iterations == ticks and costs.t_target[3] == 0.12
    assert own.counts("draft")[1][0] > 0 and not hasattr(live, "costs")
    other = LiveStats()
    copies = copy_lives({"x": live, "y": other})  # a replay's start: independent
    assert copies["x"] is not live and copies["x"].counts("draft") == live.counts("draft")
    copy = table.copy()
    copy.at("eager").observe(0, 0.3)
    assert costs.t_target[1] == 0.1 and copy.at("eager").iterations == costs.iterations + 1


def test_replay_keeps_one_cost_object_per_pair():
    from autospec.tune.replay import Costs, simulate

    costs = Costs(t_draft=0.01, t_target={1: 0.1, 4: 0.12, 8: 0.15})
    traces = [("greedy", bytes([1, 1, 0, 1] * 8)), ("greedy", bytes([0, 1] * 16))]
    lives: dict = {}
    table = costs.table()
    simulate(traces, CostModelPolicy(), costs, category=lambda r: r[1][:1].hex(),
             live=lives, table=table)
    assert len(lives) == 2 and [(r.path, r.batch) for r in table.rows()] == [(None, 1)]
    assert table.at(None).iterations > 0  # both categories' iterations fed it


# -- in the store -------------------------------------------------------------------------------
@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


def _records(n: int = 9) -> list:
    rng = random.Random(32)
    out = []
    for i in range(n):
        rec = make_record(rng, category=("code", "chat", "sql")[i % 3], pair=PAIRS[1])
        rec.path = "eager" if i % 4 else "static"
        out.append(validate_record(rec))
    return out


def _legacy_costs(records) -> list[dict]:
    """The ``category_costs`` rows 0005–0009 kept for ``records``: per (category, path)."""
    rows: dict = {}
    for r in records:
        row = rows.setdefault((r.category, r.path), dict(
            category_key=category_key(r.category), path=r.path, category=r.category,
            requests=0, draft_s=0.0, draft_forwards=0, target_s_sum_by_n=defaultdict(float),
            target_count_by_n=defaultdict(int), last_seen=None))
        row["requests"] += 1
        row["draft_s"] += r.draft_s
        row["draft_forwards"] += r.draft_forwards
        for n, ts in r.target_s_by_n.items():
            row["target_s_sum_by_n"][str(n)] += sum(ts)
            row["target_count_by_n"][str(n)] += len(ts)
        from datetime import datetime, timezone

        t = datetime.fromtimestamp(r.created_at, timezone.utc)
        row["last_seen"] = t if row["last_seen"] is None else max(row["last_seen"], t)
    return [dict(r, target_s_sum_by_n=dict(r["target_s_sum_by_n"]),
                 target_count_by_n=dict(r["target_count_by_n"])) for r in rows.values()]


def _pair_rows(session) -> dict:
    return {(c.pair_id, c.path): (c.requests, c.draft_s, c.draft_forwards,
                                  {int(n): s for n, s in c.target_s_sum_by_n.items()},
                                  {int(n): k for n, k in c.target_count_by_n.items()})
            for c in session.scalars(select(PairCost))}


def test_a_0009_store_is_upgraded_pooling_each_pairs_costs(url, tmp_path):
    """0010 sums every category's ``category_costs`` rows of a (pair, path) into one
    ``pair_costs`` row — what a store at the head writes for the same requests — keeps which
    path served each category, and loses nothing logged; the downgrade gives each category
    the pair's curve back."""
    records = _records()
    _create_at(url, "0009")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["pairs", "requests", "category_stats", "category_costs"])
    with engine.begin() as conn:
        for rec in records:
            pid, _, _ = _insert_legacy(conn, meta.tables["requests"], rec, ())
        for cat in {r.category for r in records}:
            _legacy_stats(conn, meta.tables["category_stats"], pid,
                          [r for r in records if r.category == cat])
        conn.execute(insert(meta.tables["category_costs"]),
                     [dict(row, pair_id=pid) for row in _legacy_costs(records)])
    engine.dispose()
    with open_store(url) as st:  # a writing open upgrades in place
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),) == ("0012",)
        with st.session() as s:
            migrated = _pair_rows(s)
            paths = {(c.category, c.path): c.requests for c in s.scalars(select(CategoryPath))}
            assert len(queries.recent_requests(s, limit=100)) == len(records)
            sums = {sm.category: sm for sm in queries.category_summaries(s, pair_id=pid)}
            live = stored_costs(s, pid, "chat", path="eager", source="live", min_forwards=1)
    with open_store(f"sqlite:///{tmp_path / 'head.db'}") as head:
        head.write(records)
        with head.session() as s:
            written = _pair_rows(s)
            head_sums = {sm.category: sm for sm in queries.category_summaries(s)}
    assert [path for _, path in migrated] == [path for _, path in written]
    for (pair_a, path), (pair_b, _) in zip(sorted(migrated), sorted(written)):
        got, want = migrated[(pair_a, path)], written[(pair_b, path)]
        assert got[0] == want[0] and got[2] == want[2] and got[4] == want[4]
        assert got[1] == pytest.approx(want[1]) and got[3] == pytest.approx(want[3])
    assert sum(v[0] for v in migrated.values()) == len(records)  # every request's timings
    expected_paths = defaultdict(int)
    for r in records:
        expected_paths[(r.category, r.path)] += 1
    assert paths == dict(expected_paths)
    for cat, sm in sums.items():  # acceptance and counters per category, costs the pair's
        want = head_sums[cat]
        assert (sm.requests, sm.accepted_per_position, sm.path) == (
            want.requests, want.accepted_per_position, want.path)
        assert sm.t_target_s_by_n == pytest.approx(want.t_target_s_by_n)
    pooled = migrated[(pid, "eager")]
    assert live.t_target == pytest.approx({n: pooled[3][n] / pooled[4][n] for n in pooled[3]})
    engine = _downgrade(url, "0009")
    tables = set(inspect(engine).get_table_names())
    assert "category_costs" in tables and not {"pair_costs", "category_paths"} & tables
    with engine.connect() as conn:
        rows = conn.execute(select(_reflect(engine))).mappings()
        back = {(r["category"], r["path"]): r for r in rows}
    engine.dispose()
    assert {k: r["requests"] for k, r in back.items()} == dict(expected_paths)
    for (_, path), r in back.items():
        assert r["draft_forwards"] == migrated[(pid, path)][2]  # the pair's curve, each


def _reflect(engine):
    meta = MetaData()
    meta.reflect(engine, only=["category_costs"])
    return meta.tables["category_costs"]


def test_a_catch_up_of_a_batch_of_two_categories_is_fitted_once():
    from autospec.engine.accounting import RowStep, StepTimes, account

    costs = CostTable().at("eager", 2)
    a, b = LiveStats(), LiveStats()
    times = StepTimes(batch=2, call_batch=2, target_s=0.2, draft_s=0.02, draft_tokens=2,
                      catch_up=(40, 0.1), model="draft")
    rows = [RowStep(proposer="draft", proposed=1, accepted=1, emitted=2) for _ in range(2)]
    account(FixedK(1), None, 1, rows, times, lives=[a, b], requests=[None, None], costs=costs)
    assert costs.catch_up[0] == 1  # one point in the pair's fit
    assert a.spent[0] >= 0.1 and b.spent[0] >= 0.1  # each category spent the time
