"""The store at batch > 1: schema 0004 (batch size, timings by (B, n), the probe's grid), old
databases upgraded in place, and ``queries.batch_costs``. SQLite always, PostgreSQL when
AUTOSPEC_TEST_POSTGRES_URL is set (as tests/test_store.py)."""

from __future__ import annotations

import random
import time

import pytest
from sqlalchemy import MetaData, create_engine, insert, select
from sqlalchemy.orm import Session

from autospec.costs.stored import stored_costs
from autospec.store import PairInfo, add_probe, open_store, queries
from autospec.store.migrate import _config, current_revision, head_revision
from autospec.store.tables import VERSION_TABLE, Request
from autospec.store.write import get_or_create_pair

from legacy_rows import request_row_0010, stats_columns_0010
from test_store import BACKENDS, PAIRS, fresh_url, make_record


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


@pytest.fixture
def store(url):
    s = open_store(url, busy_timeout_s=10)
    yield s
    s.close()


def batched_record(rng: random.Random, *, batch: int, category: str = "code",
                   pair: PairInfo = PAIRS[1], forwards: int = 4, t: float = 0.01):
    """A row of a batch of ``batch``: its forwards at (batch, k + 1) and its draft steps at
    ``batch``, none in the batch-1 timings."""
    rec = make_record(rng, category=category, pair=pair)
    ks = list(rec.k_schedule)
    rec.batch_size = batch
    rec.target_s_by_n = {}
    rec.target_s_by_bn = {(batch, k + 1): [t * (1 + 0.01 * i) for i in range(forwards)]
                          for k in ks}
    rec.draft_s_by_b = {batch: [t / 10] * forwards}
    return rec


def _pair_id(store, pair: PairInfo) -> int:
    with store.session() as s:
        return queries.pair_id(s, pair)


# ---- round trips -------------------------------------------------------------------------


def test_batch_size_and_batch_timings_round_trip(store):
    rng = random.Random(3)
    plain = make_record(rng, category="chat")
    rec = batched_record(rng, batch=8)
    rec.target_s_by_bn = {(8, 3): [0.02, 0.03], (4, 5): [0.01]}  # compaction: 8 rows, then 4
    rec.draft_s_by_b = {8: [0.002], 4: [0.001, 0.0015]}
    store.write([plain, rec])
    with store.session() as s:
        rows = {r.category: r for r in queries.recent_requests(s, limit=5)}
        traces = {t.category: t for t in queries.traces(s)}
    assert rows["chat"].batch_size == 1 and traces["chat"].batch_size == 1
    assert rows["chat"].target_s_by_bn == {} and rows["chat"].draft_s_by_b == {}
    got = rows["code"]
    assert got.batch_size == 8 and traces["code"].batch_size == 8
    assert got.target_s_by_bn == {(4, 5): [0.01], (8, 3): [0.02, 0.03]}
    assert got.draft_s_by_b == {4: [0.001, 0.0015], 8: [0.002]}
    assert got.target_s_by_n == {}


def test_string_keys_are_accepted_and_bad_batch_fields_are_refused(store):
    rng = random.Random(4)
    rec = batched_record(rng, batch=2)
    rec.target_s_by_bn, rec.draft_s_by_b = {"2,4": [0.01]}, {"2": [0.001]}
    store.write([rec])
    with store.session() as s:
        (row,) = queries.recent_requests(s)
    assert row.target_s_by_bn == {(2, 4): [0.01]} and row.draft_s_by_b == {2: [0.001]}
    for field, value, message in [
        ("batch_size", 0, "batch_size must be a positive int"),
        ("batch_size", 2.0, "batch_size must be a positive int"),
        ("target_s_by_bn", {4: [0.1]}, r"target_s_by_bn keys must be \(B, n\)"),
        ("target_s_by_bn", {(2, 0): [0.1]}, r"target_s_by_bn keys must be \(B, n\)"),
        ("target_s_by_bn", {(2, 3): [-1.0]}, "finite and non-negative"),
        ("draft_s_by_b", {"x": [0.1]}, "draft_s_by_b keys must be B"),
    ]:
        bad = batched_record(rng, batch=2)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=message):
            store.write([bad])


def test_batched_rows_add_counters_but_keep_their_timings_out_of_the_batch_one_curve(store):
    rng = random.Random(5)
    single = make_record(rng, category="code")
    single.bandwidth_bytes_per_s = 1e9
    rows = [batched_record(rng, batch=4) for _ in range(3)]
    for r in rows:
        r.bandwidth_bytes_per_s = 2e9
    store.write([single, *rows])
    every = [single, *rows]
    with store.session() as s:
        (sm,) = queries.category_summaries(s, category="code")
    assert sm.requests == 4
    for name in ("new_tokens", "iterations"):
        assert getattr(sm, name) == sum(getattr(r, name) for r in every), name
    for name, field_ in (("drafts", "blocks"), ("drafted", "proposed"), ("accepted", "accepted")):
        assert getattr(sm, name) == sum(getattr(r.proposers["draft"], field_) for r in every)
    assert sm.wall_s == pytest.approx(sum(r.wall_s for r in every))
    # timings: batch 1's only
    assert sm.target_count_by_n == {n: len(ts) for n, ts in single.target_s_by_n.items()}
    assert sm.draft_s == pytest.approx(single.draft_s)
    assert sm.draft_forwards == single.draft_forwards
    # bandwidth is weighted by every target forward, batched ones included
    single_s = sum(map(sum, single.target_s_by_n.values()))
    batched_s = [sum(map(sum, r.target_s_by_bn.values())) for r in rows]
    assert sm.bandwidth_s == pytest.approx(single_s + sum(batched_s))
    assert sm.bandwidth_bytes == pytest.approx(1e9 * single_s + 2e9 * sum(batched_s))


def test_a_category_seen_only_at_batch_four_has_an_empty_cost_curve(store):
    store.write([batched_record(random.Random(6), batch=4, category="only-batched")])
    with store.session() as s:
        (sm,) = queries.category_summaries(s)
        pid = sm.pair.id
        c = stored_costs(s, pid, source="live")
        t_draft, curve = c.t_draft, c.t_target
    assert sm.target_s_sum_by_n == {} and sm.t_target_s_by_n == {} and sm.t_draft_s is None
    assert sm.alpha is not None
    assert t_draft is None and curve == {}


# ---- batch_costs -------------------------------------------------------------------------


def test_batch_costs_are_none_for_an_empty_pair(store):
    store.write([make_record(random.Random(7), pair=PAIRS[1])])
    with store.session() as s:
        assert queries.batch_costs(s, queries.pair_id(s, PAIRS[1])) == ({}, {}, "none")
        assert queries.batch_costs(s, 10**9) == ({}, {}, "none")


def test_live_batch_costs_are_medians_of_well_measured_points(store):
    rng = random.Random(8)
    recs = []
    for i in range(4):  # 4 rows × 4 forwards = 16 forwards at (4, n): kept
        r = batched_record(rng, batch=4, forwards=4, t=0.01)
        r.target_s_by_bn = {(4, 3): [0.010, 0.011, 0.012, 0.013], (4, 1): [0.008] * 4}
        r.draft_s_by_b = {4: [0.002 + 0.001 * i] * 4}
        recs.append(r)
    few = batched_record(rng, batch=16)  # 15 forwards at (16, 2): dropped
    few.target_s_by_bn, few.draft_s_by_b = {(16, 2): [0.05] * 15}, {16: [0.01] * 15}
    # a compaction tail at batch 1 in the same rows (8 × 2 = 16 forwards): batch 1's point
    recs[0].target_s_by_n = {2: [0.004] * 8}
    recs[1].target_s_by_n = {2: [0.006] * 8}
    recs[2].target_s_by_n = {2: [0.009] * 8}  # listed twice (as the batched loop does):
    recs[2].target_s_by_bn[1, 2] = [0.009] * 8  # counted once, else the median moves
    store.write([*recs, few, make_record(rng, pair=PAIRS[1])])  # + an unbatched request
    pid = _pair_id(store, PAIRS[1])
    with store.session() as s:
        target, draft, source = queries.batch_costs(s, pid)
    assert source == "live"
    assert target == {1: {2: pytest.approx(0.006)},
                      4: {1: pytest.approx(0.008), 3: pytest.approx(0.0115)}}
    assert draft == {4: pytest.approx(0.0035)}
    with store.session() as s:  # a lower bar keeps the thin point
        target, draft, _ = queries.batch_costs(s, pid, min_forwards=15)
    assert target[16] == {2: pytest.approx(0.05)} and draft[16] == pytest.approx(0.01)


def _probe_payload(t1: float, draft: float, grid=None, draft_grid=None) -> dict:
    payload = {"path": "eager", "target_s_by_n": {1: t1, 2: round(t1 * 1.1, 6)},
               "draft_s": draft}
    if grid is not None:
        payload.update(grid=grid, draft_grid=draft_grid)
    return payload


def test_the_probe_grid_is_the_one_source_when_stored(store):
    rng = random.Random(9)
    store.write([batched_record(rng, batch=4, forwards=16)])
    pid = _pair_id(store, PAIRS[1])
    grid = {1: {1: 0.010, 2: 0.011}, 4: {1: 0.012, 2: 0.020}}
    with store.begin() as s:
        add_probe(s, pid, _probe_payload(0.010, 0.002, grid, {1: 0.002, 4: 0.003}))
    with store.session() as s:
        target, draft, source = queries.batch_costs(s, pid)
        row = queries.latest_probe(s, pid)
    assert source == "probe"  # not the live (4, n) points
    assert target == grid and draft == {1: 0.002, 4: 0.003}
    assert row.grid == grid and "grid" not in row.payload
    assert target[1] == {int(n): t for n, t in row.payload["target_s_by_n"].items()}
    # a later probe at batch 1 alone does not hide the grid; its own curve is not mixed in
    time.sleep(0.01)
    with store.begin() as s:
        add_probe(s, pid, _probe_payload(0.5, 0.1, {1: {1: 0.5, 2: 0.55}}, {1: 0.1}))
    with store.session() as s:
        assert queries.batch_costs(s, pid) == (grid, {1: 0.002, 4: 0.003}, "probe")


def test_a_probe_at_batch_one_only_gives_batch_one_when_nothing_live(store):
    store.write([make_record(random.Random(10), pair=PAIRS[1])])
    pid = _pair_id(store, PAIRS[1])
    with store.begin() as s:
        add_probe(s, pid, _probe_payload(0.010, 0.002))  # stored before the batch dimension
    with store.session() as s:
        target, draft, source = queries.batch_costs(s, pid)
    assert (target, draft, source) == ({1: {1: 0.010, 2: 0.011}}, {1: 0.002}, "probe")


# ---- upgrading a 0003 database -----------------------------------------------------------


def _create_at(url: str, revision: str) -> None:
    from alembic import command

    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = _config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    engine.dispose()


def _legacy_stats(conn, table, pair_id: int, records) -> None:
    """The ``category_stats`` row of ``records`` as schema 0010 folded them, written into an
    older schema's ``table`` (reflected) through ``conn``, without the columns that schema
    lacks (the ORM models are the head's: their fold cannot run on an older table)."""
    from autospec.store.tables import Base, CategoryStat
    from autospec.store.write import _Delta, _fold_stats, category_key

    scratch = create_engine("sqlite://")
    Base.metadata.create_all(scratch)
    with Session(scratch) as s:
        delta = _Delta(records[0].category)
        for r in records:
            delta.add(r)
        _fold_stats(s, pair_id, category_key(delta.category), delta)
        s.flush()
        row = dict(s.execute(select(CategoryStat.__table__)).mappings().one())
    scratch.dispose()
    row.update(stats_columns_0010(records))
    conn.execute(insert(table).values({k: v for k, v in row.items() if k in table.c}))


def _insert_legacy(conn, table, rec, absent: tuple[str, ...]) -> tuple[int, dict, dict]:
    """Write ``rec`` into an older schema's requests ``table`` (its pair first): the row as
    schema 0010 kept it (``legacy_rows``), without the columns ``absent`` that schema lacks.
    (pair id, row, what was left out)."""
    with Session(conn) as s:
        pid = get_or_create_pair(s, rec.pair)
        s.flush()
    row = request_row_0010(rec, pid)
    dropped = {name: row.pop(name) for name in absent}
    conn.execute(insert(table).values(**row))
    return pid, row, dropped


def _downgrade(url: str, revision: str):
    """Migrate the store at ``url`` down to ``revision``; the engine, for the caller to
    inspect and dispose."""
    from alembic import command

    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = _config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
        assert current_revision(conn) == (revision,)
    return engine


def test_a_0003_database_is_upgraded_in_place_and_its_rows_read_as_batch_one(url):
    _create_at(url, "0003")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["pairs", "requests", "probes", VERSION_TABLE])
    assert "batch_size" not in meta.tables["requests"].c
    rec = make_record(random.Random(11), category="code", pair=PAIRS[1])
    with engine.begin() as conn:
        assert current_revision(conn) == ("0003",)
        pid, row, _ = _insert_legacy(  # without what schema 0003 lacks
            conn, meta.tables["requests"], rec,
            ("batch_size", "target_s_by_bn", "draft_s_by_b", "path", "ngram",
             "proposer_schedule", "ngram_trace", "draft_catch_ups", "suffix",
             "suffix_trace", "decisions"))
        conn.execute(insert(meta.tables["probes"]).values(
            pair_id=pid, created_at=row["created_at"], payload=_probe_payload(0.01, 0.001)))
    engine.dispose()

    with open_store(url) as st:
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),)
        with st.session() as s:
            (got,) = queries.recent_requests(s)
            (trace,) = queries.traces(s)
            assert s.scalar(select(Request.batch_size)) == 1
            costs = queries.batch_costs(s, pid)
        assert got.batch_size == 1 and trace.batch_size == 1
        assert got.target_s_by_bn == {} and got.draft_s_by_b == {}
        assert got.trace == rec.proposers["draft"].trace
        assert got.target_s_by_n == rec.target_s_by_n
        # a probe from before 0005 timed bare forwards on an unknown path: no path's costs
        assert got.path is None
        assert costs == ({}, {}, "none")
        st.write([batched_record(random.Random(12), batch=2)])  # and new rows still write
        with st.session() as s:
            assert sorted(r.batch_size for r in queries.recent_requests(s)) == [1, 2]
