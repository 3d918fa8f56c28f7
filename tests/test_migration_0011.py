"""Schema 0011: every per-proposer column of a store written before it (the draft model's
counters and trace, prompt lookup's ``ngram``, suffix decoding's ``suffix``, their traces, the
schedule's codes) moves into per-proposer rows and reads back the same; downgrading puts every
column back as it was. Opened through ``open_store`` (SQLite with its foreign keys enforced),
on SQLite and on PostgreSQL where AUTOSPEC_TEST_POSTGRES_URL is set."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import MetaData, create_engine, select
from test_store_batch import _create_at, _downgrade, _insert_legacy, _legacy_stats

from autospec.store import PairInfo, open_store, queries
from autospec.store.record import ProposerRecord
from autospec.store.write import validate_record
from autospec.traces import NGRAM_NONE, NGRAM_TRACE_K, encode_trace_value

from legacy_rows import stats_columns_0010
from records import blocks, draft, lookup
from test_store import BACKENDS, PAIRS, fresh_url, make_record

NO_DRAFT = PairInfo("org/target", "none (n-gram)", "float32", "cpu: 2 threads")


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


def _lookup_trace(rng: random.Random, n: int, width: int = 1) -> bytes:
    """Any byte a position for prompt lookup's trace; for suffix decoding's (width 2) a pair
    its encoding holds: (match and agreement, draft length) or (NGRAM_NONE, 0)."""
    if width == 1:
        return bytes(rng.randrange(256) for _ in range(n))
    out = []
    for _ in range(n):
        size = rng.randint(0, NGRAM_TRACE_K)
        out += [encode_trace_value(rng.randint(1, 24), rng.randint(0, size)), size] if size \
            else [NGRAM_NONE, 0]
    return bytes(out)


def _records() -> list:
    """Requests of every shape 0010 kept: the draft model alone (with its confidences), the
    draft model beside prompt lookup and beside suffix decoding (a schedule naming each), and
    prompt lookup on a pair without a draft model."""
    rng = random.Random(11)
    out = []
    alone = make_record(rng, category="code", pair=PAIRS[1])
    alone.proposers["draft"].confidence = bytes(rng.randrange(256)
                                                for _ in range(alone.new_tokens))
    alone.proposer_schedule = ["draft"] * alone.iterations
    out.append(alone)
    for name, width, settings in (("ngram", 1, {"max_n": 4, "min_n": 2}), ("suffix", 2, None)):
        ks, acc, who = [3, 2, 0, 4, 1], [1, 2, 0, 4, 0], ["draft", name, None, name, "draft"]
        rec = make_record(rng, category="code", pair=PAIRS[1])
        n = sum(acc) + len(ks)
        rec.k_schedule, rec.accepted_schedule = bytes(ks), bytes(acc)
        rec.iterations, rec.new_tokens, rec.proposer_schedule = len(ks), n, who
        mine = [(k, a) for k, a, w in zip(ks, acc, who) if w == "draft"]
        theirs = [(k, a) for k, a, w in zip(ks, acc, who) if w == name]
        rec.proposers = {**draft(trace=bytes(rng.choice((0, 1, 255)) for _ in range(n)),
                                 **blocks(*zip(*mine))),
                         **lookup(name, trace=_lookup_trace(rng, n, width), settings=settings,
                                  seconds=0.125, **blocks(*zip(*theirs)))}
        rec.greedy, rec.trace_kind = True, "greedy"
        out.append(rec)
    ks, acc = [2, 0, 3], [2, 0, 1]
    bare = make_record(rng, category="chat", pair=NO_DRAFT)
    bare.k_schedule, bare.accepted_schedule = bytes(ks), bytes(acc)
    bare.iterations, bare.new_tokens = 3, sum(acc) + 3
    bare.proposer_schedule = ["ngram", None, "ngram"]
    bare.proposers = lookup("ngram", trace=_lookup_trace(rng, bare.new_tokens),
                            settings={"max_n": 3, "min_n": 1}, seconds=0.5, **blocks(ks, acc))
    out.append(bare)
    return [validate_record(r) for r in out]


def _same(got, want: ProposerRecord) -> None:
    assert got.kind == want.kind
    for name in ("blocks", "proposed", "accepted", "seconds", "trace", "confidence", "settings"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("proposed_per_position", "accepted_per_position"):
        assert list(getattr(got, name)) == list(getattr(want, name)), name


def _read_back(url: str, recs) -> None:
    """What the store at head reads of ``recs``: every proposer's row, the schedule by name,
    each category's sums per proposer."""
    with open_store(url) as st, st.session() as s:
        rows = sorted(queries.recent_requests(s, limit=10), key=lambda r: r.id)
        sums = {sm.category: sm for sm in queries.category_summaries(s)}
    assert len(rows) == len(recs)
    for row, rec in zip(rows, recs):
        assert set(row.proposers) == set(rec.proposers), rec.category
        for name, want in rec.proposers.items():
            _same(row.proposers[name], want)
        assert row.proposer_schedule == rec.proposer_schedule
    for category in ("code", "chat"):
        mine = [r for r in recs if r.category == category]
        sm = sums[category]
        # every proposer's sums are its requests' (0010 kept no suffix sums: the upgrade
        # adds them up from the request rows)
        names = {n for r in mine for n in r.proposers}
        assert set(sm.proposers) == names, category
        for name in names:
            got, theirs = sm.proposers[name], [r.proposers[name] for r in mine
                                               if name in r.proposers]
            for f in ("blocks", "proposed", "accepted"):
                assert getattr(got, f) == sum(getattr(p, f) for p in theirs), (name, f)
            for f in ("proposed_per_position", "accepted_per_position"):
                width = max(len(getattr(p, f)) for p in theirs)
                assert list(getattr(got, f)) == [
                    sum(getattr(p, f)[i] for p in theirs if i < len(getattr(p, f)))
                    for i in range(width)], (name, f)
            assert got.seconds == pytest.approx(sum(p.seconds for p in theirs))


def test_every_proposer_column_moves_into_rows_and_back(url):
    _create_at(url, "0010")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["requests", "category_stats"])
    recs = _records()
    inserted, stats = [], {}
    with engine.begin() as conn:
        for rec in recs:
            pid, row, _ = _insert_legacy(conn, meta.tables["requests"], rec, ())
            inserted.append(row)
            stats.setdefault((rec.category, pid), []).append(rec)
        for (_, pid), mine in stats.items():
            _legacy_stats(conn, meta.tables["category_stats"], pid, mine)
    engine.dispose()

    _read_back(url, recs)  # open_store upgrades it

    engine = _downgrade(url, "0010")  # every column back, as 0010 wrote it
    meta = MetaData()
    meta.reflect(engine, only=["requests", "category_stats"])
    req, cs = meta.tables["requests"], meta.tables["category_stats"]
    with engine.connect() as conn:
        back = list(conn.execute(select(req).order_by(req.c.id)).mappings())
        stat_rows = {r["pair_id"]: r for r in conn.execute(select(cs)).mappings()}
    engine.dispose()
    assert len(back) == len(inserted)
    for got, want in zip(back, inserted):
        for name in ("drafts", "drafted", "accepted", "accepted_per_position",
                     "drafted_per_position", "trace", "confidence", "ngram", "ngram_trace",
                     "suffix", "suffix_trace", "proposer_schedule", "k_schedule"):
            value = got[name]
            value = bytes(value) if isinstance(value, memoryview) else value
            assert value == want[name], name
    for (_, pid), mine in stats.items():
        want = stats_columns_0010(mine)
        for name, value in want.items():
            assert stat_rows[pid][name] == (pytest.approx(value) if isinstance(value, float)
                                            else value), name

    _read_back(url, recs)  # and up again: the same rows


def test_a_store_at_head_writes_and_reads_any_registered_name(url):
    """A proposer this code does not know of by name (a package's) keeps its own row."""
    rec = make_record(random.Random(3), category="code", pair=PAIRS[1])
    rec.proposers.update(lookup("phrasebook", trace=bytes(rec.new_tokens),
                                settings={"snippets": 2}, seconds=0.01, **blocks([2], [1])))
    with open_store(url) as st:
        st.write([rec])
        with st.session() as s:
            (row,) = queries.recent_requests(s)
            (sm,) = queries.category_summaries(s)
    _same(row.proposers["phrasebook"], rec.proposers["phrasebook"])
    assert sm.proposers["phrasebook"].accepted == 1
    assert sm.proposers["draft"].accepted == rec.proposers["draft"].accepted
