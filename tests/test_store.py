"""The store's contract, run over every backend: SQLite (a temporary file) always, PostgreSQL
when AUTOSPEC_TEST_POSTGRES_URL is set (CI starts a server; AUTOSPEC_REQUIRE_POSTGRES=1 turns
its absence into a failure). Real databases throughout, no mocks."""

from __future__ import annotations

import hashlib
import importlib
import math
import os
import random
import sqlite3
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from autospec.store import (
    PairInfo,
    RequestRecord,
    StoreError,
    add_probe,
    open_store,
    queries,
)
from autospec.store.migrate import current_revision, head_revision
from autospec.store.tables import VERSION_TABLE, Base, CategoryStat, Request

from records import blocks, draft, lookup

PG_URL = os.environ.get("AUTOSPEC_TEST_POSTGRES_URL")
REQUIRE_PG = os.environ.get("AUTOSPEC_REQUIRE_POSTGRES") == "1"
BACKENDS = ["sqlite", "postgresql"]

# ---- records -----------------------------------------------------------------------------

LONG = "".join(random.Random(7).choice("αβγ日本語🚀\"'\\;%_ \t\nx") for _ in range(10_000))
CATEGORIES = ["code", "chat \"double\" 'single' `tick` ; DROP TABLE requests; --",
              "naïve café 日本語 🚀 \u200b", LONG]
PAIRS = [PairInfo("org/target-7b", "org/draft-0.5b", "bfloat16", "cuda: NVIDIA H200",
                  14_000_000_000, 1_000_000_000),
         PairInfo("/models/tiny target", "/models/tiny draft", "float32", "cpu: 2 threads")]


def make_record(rng: random.Random, *, category: str | None = None,
                pair: PairInfo | None = None, text_too: bool = False) -> RequestRecord:
    """A plausible request: k per iteration, accepted ≤ k, counters consistent with them."""
    iterations = rng.randint(1, 12)
    ks = [rng.randint(1, 8) for _ in range(iterations)]
    acc = [rng.randint(0, k) for k in ks]
    greedy = rng.random() < 0.5
    new_tokens = sum(acc) + iterations
    by_n: dict[int, list[float]] = defaultdict(list)
    for k in ks:
        by_n[k + 1].append(rng.uniform(0.001, 0.05))
    return RequestRecord(
        pair=pair or rng.choice(PAIRS), category=category or rng.choice(CATEGORIES),
        policy=rng.choice(["fixed(4)", "adaptive", "off"]), greedy=greedy,
        prompt_tokens=rng.randint(1, 500), new_tokens=new_tokens, iterations=iterations,
        proposers=draft(trace=bytes(rng.choice((0, 1, 255)) if greedy else rng.randint(0, 255)
                                    for _ in range(new_tokens)), **blocks(ks, acc)),
        k_schedule=bytes(ks), accepted_schedule=bytes(acc), wall_s=rng.uniform(0.01, 2.0),
        prefill_s=rng.uniform(0.001, 0.1), draft_s=rng.uniform(0.001, 0.5),
        draft_forwards=sum(ks), target_s_by_n=dict(by_n),
        trace_kind="greedy" if greedy else "sampled",
        stop_reason=rng.choice(["eos", "max_new_tokens", "stop_string"]),
        bandwidth_bytes_per_s=rng.choice([None, rng.uniform(1e9, 4e12)]),
        bandwidth_peak_bytes_per_s=rng.choice([None, 4.8e12]),
        nvml_mem_busy_pct=rng.choice([None, rng.uniform(0, 100)]),
        nvml_sm_util_pct=rng.choice([None, rng.uniform(0, 100)]),
        prompt_text="def f(x):\n    return 'ok' \"\" 日本" if text_too else None,
        output_text="  pass  🚀" if text_too else None,
        created_at=time.time() - rng.uniform(0, 3600), path="eager")


def expected_stats(records) -> dict[tuple[str, PairInfo], dict]:
    """category_stats computed directly from the records."""
    out: dict = {}
    for r in records:
        e = out.setdefault((r.category, r.pair), defaultdict(int, acc=Counter(), dr=Counter(),
                           ts=Counter(), tc=Counter(), k=Counter(), first=math.inf,
                           last=-math.inf))
        e["requests"] += 1
        for name in ("prompt_tokens", "new_tokens", "iterations", "draft_forwards", "draft_s",
                     "wall_s", "prefill_s"):
            e[name] += getattr(r, name)
        m = r.proposers["draft"]  # the headline figures are the model proposer's
        e["drafts"] += m.blocks
        e["drafted"] += m.proposed
        e["accepted"] += m.accepted
        e["acc"].update(dict(enumerate(m.accepted_per_position)))
        e["dr"].update(dict(enumerate(m.proposed_per_position)))
        for n, ts in r.target_s_by_n.items():
            e["ts"][n] += sum(ts)
            e["tc"][n] += len(ts)
        e["k"].update(r.k_schedule)
        target_s = sum(sum(ts) for ts in r.target_s_by_n.values())
        if r.bandwidth_bytes_per_s is not None:
            e["bandwidth_bytes"] += r.bandwidth_bytes_per_s * target_s
            e["bandwidth_s"] += target_s
        if r.bandwidth_peak_bytes_per_s is not None:
            e["peak"] = max(e.get("peak") or 0, r.bandwidth_peak_bytes_per_s)
        for name in ("nvml_mem_busy", "nvml_sm_util"):
            if getattr(r, f"{name}_pct") is not None:
                e[f"{name}_sum"] += getattr(r, f"{name}_pct")
                e[f"{name}_n"] += 1
        e["first"], e["last"] = min(e["first"], r.created_at), max(e["last"], r.created_at)
    return out


def pair_costs(records) -> dict[PairInfo, dict]:
    """Batch 1's timing sums per pair (every record here is batch 1 on "eager"): the pair's
    costs, every category's requests pooled (``pair_costs``), which a category's summary
    shows beside its own acceptance and counters."""
    out: dict = {}
    for r in records:
        e = out.setdefault(r.pair, dict(draft_forwards=0, draft_s=0.0, ts=Counter(),
                                        tc=Counter()))
        e["draft_forwards"] += r.draft_forwards
        e["draft_s"] += r.draft_s
        for n, ts in r.target_s_by_n.items():
            e["ts"][n] += sum(ts)
            e["tc"][n] += len(ts)
    return out


def assert_stats_match(session, records, check_times: bool = True) -> None:
    want = expected_stats(records)
    costs = pair_costs(records)
    got = {(s.category, s.pair.target, s.pair.draft): s
           for s in queries.category_summaries(session)}
    assert len(got) == len(want)
    for (category, pair), e in want.items():
        s = got[(category, pair.target, pair.draft)]
        for name in ("requests", "prompt_tokens", "new_tokens", "iterations", "drafts",
                     "drafted", "accepted"):
            assert getattr(s, name) == e[name], name
        c = costs[pair]  # the timing fields are the pair's (costs once, per (pair, path))
        assert s.draft_forwards == c["draft_forwards"]
        assert s.draft_s == pytest.approx(c["draft_s"], rel=1e-9)
        assert s.target_count_by_n == dict(c["tc"])
        assert s.target_s_sum_by_n == pytest.approx(dict(c["ts"]), rel=1e-9)
        for name in ("nvml_mem_busy_n", "nvml_sm_util_n"):
            assert getattr(s, name) == e[name], name
        for name in ("wall_s", "prefill_s", "bandwidth_bytes", "bandwidth_s",
                     "nvml_mem_busy_sum", "nvml_sm_util_sum"):
            assert getattr(s, name) == pytest.approx(e[name], rel=1e-9), name
        assert s.bandwidth_peak_bytes_per_s == e.get("peak")
        assert list(s.accepted_per_position) == [e["acc"][i] for i in range(len(e["acc"]))]
        assert list(s.drafted_per_position) == [e["dr"][i] for i in range(len(e["dr"]))]
        assert s.k_counts == dict(e["k"])
        if check_times:
            assert s.first_seen.timestamp() == pytest.approx(e["first"], abs=1e-5)
            assert s.last_seen.timestamp() == pytest.approx(e["last"], abs=1e-5)


# ---- store URLs --------------------------------------------------------------------------


def pg_url_or_skip() -> str:
    if PG_URL:
        return PG_URL
    if REQUIRE_PG:
        pytest.fail("AUTOSPEC_REQUIRE_POSTGRES=1 but AUTOSPEC_TEST_POSTGRES_URL is not set")
    pytest.skip("PostgreSQL: set AUTOSPEC_TEST_POSTGRES_URL=postgresql+psycopg://… (.ci/run "
                "starts a server and sets it)")


def fresh_url(backend: str, tmp_path: Path):
    """(url, cleanup) of an empty database: a new SQLite file, or a new PostgreSQL schema
    (selected through search_path) that cleanup drops."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / f'store-{uuid.uuid4().hex[:8]}.db'}", lambda: None
    base = make_url(pg_url_or_skip())
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    url = base.update_query_dict({"options": f"-csearch_path={schema}"})

    def cleanup() -> None:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()

    return url.render_as_string(hide_password=False), cleanup


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


def count_requests(store) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(Request))


# ---- contract ----------------------------------------------------------------------------


def test_round_trip_keeps_every_field(store):
    rng = random.Random(1)
    recs = [make_record(rng, category=c, text_too=True) for c in CATEGORIES]
    recs[0].new_tokens = 256  # one trace byte per position, and every byte value survives
    recs[0].proposers["draft"].trace = bytes(range(256))
    recs[1].proposers.update(lookup("ngram", trace=bytes((0, 7, 255)[i % 3] for i in range(recs[1].new_tokens)),
                                    settings={"max_n": 3},
                                    **blocks([2, 0, 3], [1, 0, 3]), seconds=0.25))
    store.write(recs)
    with store.session() as s:
        rows = {r.category: r for r in queries.recent_requests(s, limit=10)}
        assert {p.target for p in queries.pairs(s)} <= {p.target for p in PAIRS}
    assert set(rows) == set(CATEGORIES)
    for rec in recs:
        row = rows[rec.category]
        for name in ("category", "policy", "greedy", "prompt_tokens", "new_tokens",
                     "iterations", "k_schedule", "accepted_schedule", "trace_kind",
                     "wall_s", "prefill_s", "draft_s", "draft_forwards",
                     "target_s_by_n", "bandwidth_bytes_per_s", "bandwidth_peak_bytes_per_s",
                     "nvml_mem_busy_pct", "nvml_sm_util_pct", "prompt_text", "output_text",
                     "stop_reason"):
            assert getattr(row, name) == getattr(rec, name), name
        assert set(row.proposers) == set(rec.proposers)
        for pname, want in rec.proposers.items():  # every proposer's row, its trace included
            got = row.proposers[pname]
            assert (got.name, got.kind) == (pname, want.kind)
            for name in ("blocks", "proposed", "accepted", "seconds", "trace", "confidence",
                         "settings"):
                assert getattr(got, name) == getattr(want, name), (pname, name)
            for name in ("proposed_per_position", "accepted_per_position"):
                assert list(getattr(got, name)) == getattr(want, name), (pname, name)
        assert row.created_at.tzinfo is not None
        assert row.created_at.timestamp() == pytest.approx(rec.created_at, abs=1e-5)
    assert len(rows[LONG].category) == 10_000


def test_category_stats_equal_the_sums_of_the_records(store):
    rng = random.Random(2)
    recs = [make_record(rng) for _ in range(300)]
    with store.writer(batch=37) as w:  # several batches, several rows each
        assert all(w.submit(r) for r in recs)
        assert w.flush(30)
        assert w.stats().written == 300 and w.stats().failures == 0
    assert count_requests(store) == 300
    with store.session() as s:
        assert_stats_match(s, recs)
        one = queries.category_summaries(s, category=LONG)
        assert {x.category for x in one} == {LONG}
        pid = queries.pairs(s)[0].id
        assert {x.pair_id for x in queries.category_summaries(s, pair_id=pid)} == {pid}


def test_empty_category_is_refused_directly_and_counted_by_the_writer(store):
    rng = random.Random(3)
    good, bad = make_record(rng), make_record(rng, category="x")
    bad.category = ""
    with pytest.raises(ValueError, match="non-empty"):
        store.write([good, bad])
    assert count_requests(store) == 0  # nothing of the refused call was written
    nul = make_record(rng, category="a\x00b")
    with pytest.raises(ValueError, match="NUL"):
        store.write([nul])
    with store.writer() as w:
        assert w.submit(bad) and w.submit(good) and w.submit(nul)
        assert w.flush(10)
        st = w.stats()
    assert (st.written, st.failures, st.rejected) == (1, 2, 2)
    assert "category" in st.last_error
    assert count_requests(store) == 1


def test_the_draft_models_trace_holds_one_byte_per_position(store):
    """Checked by its proposer's rule where the process has the registry loaded (where the
    engine made the record); loaded here, as a serving process has it."""
    importlib.import_module("autospec.engine.proposers")
    rec = make_record(random.Random(9))
    rec.proposers["draft"].trace = bytes(2 * rec.new_tokens)  # a whole number, but not its own
    with pytest.raises(ValueError, match=r"not a draft trace of this request: .* 1 per position"):
        store.write([rec])
    assert count_requests(store) == 0


def test_confidence_round_trips_and_must_match_the_trace(store):
    rng = random.Random(8)
    rec, bare = make_record(rng), make_record(rng)
    conf = bytes((7 * i) % 256 for i in range(rec.new_tokens))
    rec.proposers["draft"].confidence = conf
    store.write([rec, bare])
    with store.session() as s:
        rows = {r.id: r for r in queries.traces(s)}
        assert [r.confidence for r in rows.values()] == [conf, None]
        assert queries.recent_requests(s, limit=2)[1].proposers["draft"].confidence == conf
    short = make_record(rng)
    short.proposers["draft"].confidence = bytes(short.new_tokens - 1)
    with pytest.raises(ValueError, match="one per position"):
        store.write([short])


def test_traces_filter_by_category_pair_and_time(store):
    rng = random.Random(4)
    old = [make_record(rng, category="code", pair=PAIRS[0]) for _ in range(5)]
    for r in old:
        r.created_at = 1_000_000.0
    new = [make_record(rng, category="code", pair=PAIRS[0]) for _ in range(5)]
    other = [make_record(rng, category="chat", pair=PAIRS[1]) for _ in range(3)]
    store.write(old + new + other)
    with store.session() as s:
        pid = {p.target: p.id for p in queries.pairs(s)}[PAIRS[0].target]
        got = list(queries.traces(s, category="code", pair_id=pid))
        assert [t.trace for t in got] == [r.proposers["draft"].trace for r in old + new]
        kind, traces, ks, acc = got[0][:4]
        assert (kind, traces, ks, acc) == (old[0].trace_kind,
                                           {"draft": old[0].proposers["draft"].trace},
                                           old[0].k_schedule, old[0].accepted_schedule)
        assert got[0].category == "code" and got[0].created_at.timestamp() == 1_000_000.0
        assert len(list(queries.traces(s, category="code", since=2_000_000.0))) == 5
        assert len(list(queries.traces(s, category="code", until=2_000_000.0))) == len(old)
        assert len(list(queries.traces(s, limit=4))) == 4
        latest = list(queries.traces(s, category="code", limit=3, newest=True))
        assert [t.trace for t in latest] == [r.proposers["draft"].trace for r in new[-3:]]
        assert list(queries.traces(s, category="nobody")) == []


def test_latest_probe_is_the_newest_of_its_pair(store):
    with store.begin() as s:
        first = add_probe(s, PAIRS[0], {"t_target_s_by_n": {"1": 0.01}, "t_draft_s": 0.001})
        second = add_probe(s, PAIRS[0], {"t_target_s_by_n": {"1": 0.02}, "bandwidth": 1e12})
        add_probe(s, PAIRS[1], {"x": 1})
    with store.session() as s:
        pid = {p.target: p.id for p in queries.pairs(s)}[PAIRS[0].target]
        probe = queries.latest_probe(s, pid)
        assert probe.id == second != first
        assert probe.payload == {"t_target_s_by_n": {"1": 0.02}, "bandwidth": 1e12}
        assert queries.latest_probe(s, 10**9) is None


def test_reopening_keeps_data_and_schema(url):
    with open_store(url) as a:
        a.write([make_record(random.Random(5))])
    with open_store(url) as b:
        assert count_requests(b) == 1
        with b.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),)


def test_models_match_the_migrations(store):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == []


def test_a_newer_schema_is_refused_and_left_unchanged(url, tmp_path):
    open_store(url).close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'"))
    engine.dispose()
    path = Path(make_url(url).database) if url.startswith("sqlite") else None
    if path:  # a newer version might not use WAL: not even the journal mode may change
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    before = path.read_bytes() if path else None
    with pytest.raises(StoreError, match=r"newer autospec \(schema revision 9999_future"):
        open_store(url)
    if path:
        assert path.read_bytes() == before
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}")) == "9999_future"
    engine.dispose()


def test_summary_figures_follow_the_vllm_convention_and_weight_bandwidth_by_time(store):
    rec = make_record(random.Random(6), category="math")
    m = rec.proposers["draft"]
    m.blocks, m.proposed, m.accepted = 4, 10, 6
    m.accepted_per_position, m.proposed_per_position = [4, 2, 0], [4, 4, 2]
    rec.draft_s, rec.draft_forwards = 0.5, 10
    rec.target_s_by_n = {3: [0.1, 0.3], 4: [0.2]}
    rec.k_schedule = bytes([3, 3, 2, 2])
    rec.bandwidth_bytes_per_s, rec.bandwidth_peak_bytes_per_s = 1e12, 4e12
    rec.nvml_mem_busy_pct, rec.nvml_sm_util_pct = 80.0, None
    slow = make_record(random.Random(16), category="math")
    slow.target_s_by_n = {1: [1.8]}  # 3× the time at half the bandwidth
    slow.bandwidth_bytes_per_s, slow.bandwidth_peak_bytes_per_s = 0.5e12, 4e12
    slow.nvml_mem_busy_pct, slow.nvml_sm_util_pct = 40.0, None
    store.write([rec])
    with store.session() as s:
        (sm,) = queries.category_summaries(s, category="math")
    assert sm.alpha == 0.6 and sm.mean_accepted_length == 1 + 6 / 4
    assert sm.acceptance_by_position == (1.0, 0.5, 0.0)
    assert sm.t_draft_s == 0.05 and sm.t_target_s_by_n == pytest.approx({3: 0.2, 4: 0.2})
    assert sm.k_counts == {3: 2, 2: 2}
    lo, hi = sm.alpha_ci95
    assert lo < 0.6 < hi and (lo, hi) == pytest.approx((0.3127, 0.8318), abs=1e-4)
    assert sm.to_dict()["alpha"] == 0.6
    store.write([slow])  # bandwidth: bytes moved over time spent, not a mean of rates
    with store.session() as s:
        (sm,) = queries.category_summaries(s, category="math")
    assert sm.bandwidth_bytes_per_s == pytest.approx((0.6 * 1e12 + 1.8 * 0.5e12) / 2.4)
    assert sm.bandwidth_utilisation == pytest.approx(0.625e12 / 4e12)
    assert (sm.nvml_mem_busy_pct, sm.nvml_sm_util_pct) == (60.0, None)


def test_sha256_keys_are_what_the_tables_index(store):
    store.write([make_record(random.Random(14), category=LONG)])
    with store.session() as s:
        key = s.scalar(select(CategoryStat.category_key))
    assert key == hashlib.sha256(LONG.encode()).hexdigest()
