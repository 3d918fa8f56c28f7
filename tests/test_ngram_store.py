"""The n-gram proposer in the store (schema 0006): its trace against a brute-force definition
and against what live greedy verification accepted, per-request counters and proposer
schedule, category sums, ``autospec stats``, deferred work on the writer thread (never on the
request's, never failing ``generate``), and old databases upgraded in place. Real SQLite files
(PostgreSQL too where AUTOSPEC_TEST_POSTGRES_URL is set, as tests/test_store.py), real tiny
models."""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch
from sqlalchemy import MetaData, create_engine, inspect, select
from test_ngram import _repetitive, _repetitive_batch, _scan
from test_store_batch import _create_at, _downgrade, _insert_legacy, _legacy_stats

import autospec
import autospec.engine.proposers.prompt_lookup as telemetry  # where the trace is made
from autospec.ngram import (
    DEFAULT_MAX_N,
    DEFAULT_MIN_N,
    NGRAM_NONE,
    NGRAM_TRACE_K,
    NgramIndex,
    decode_trace_value,
    encode_trace_value,
    ngram_trace,
)
from autospec.store import open_store, queries
from autospec.store.migrate import current_revision, head_revision
from autospec.store.tables import CategoryStat, Request
from autospec.store.write import validate_record

from conftest import noisy_copy, prompt, tiny
from test_store import BACKENDS, PAIRS, fresh_url, make_record


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


@pytest.fixture(scope="module")
def models():
    target = tiny("qwen2", layers=2, seed=5)
    return target, noisy_copy(target, 0.1)


# -- the trace against its definition ---------------------------------------------------------
def _brute_trace(tokens, prompt_len, max_n, min_n, k):
    """The definition, by scanning: at each generated position t, the match of tokens[:t]
    (``test_ngram._scan``: the longest suffix that also ended earlier, of its latest
    OCCURRENCES ends the one e agreeing furthest back, ties to the first at or after the copy
    cursor, else the latest), the proposal tokens[e:e+k] continued with period t − e; how
    many of it match. The cursor moves past each generated token the match before it
    predicted."""
    out, cursor = [], None
    for t in range(prompt_len, len(tokens)):
        hist = tokens[:t]
        matched, end = _scan(hist, cursor, max_n, min_n)
        if not matched:
            out.append(NGRAM_NONE)
            continue
        if hist[end] == tokens[t]:
            cursor = end + 1
        proposal = [hist[end + i] if end + i < t else None for i in range(k)]
        for i in range(k):
            if proposal[i] is None:
                proposal[i] = proposal[i - (t - end)]
        same = 0
        while same < k and t + same < len(tokens) and proposal[same] == tokens[t + same]:
            same += 1
        out.append(encode_trace_value(matched, same))
    return bytes(out)


@pytest.mark.parametrize("max_n, min_n, k, alphabet", [
    (3, 1, 16, 4), (4, 2, 16, 3), (2, 2, 5, 6), (1, 1, 3, 2), (5, 1, 16, 12)])
def test_the_trace_is_its_definition(max_n, min_n, k, alphabet):
    rng = random.Random(max_n * 100 + min_n * 10 + k)
    for _ in range(6):
        base = [rng.randrange(alphabet) for _ in range(rng.randint(0, 30))]
        tokens = base + [rng.randrange(alphabet) if rng.random() < 0.3
                         else base[rng.randrange(len(base))] if base else 0
                         for _ in range(rng.randint(0, 90))]
        prompt_len = rng.randint(0, len(tokens))
        got = ngram_trace(tokens, prompt_len, max_n=max_n, min_n=min_n, k=k)
        assert got == _brute_trace(tokens, prompt_len, max_n, min_n, k)
        assert len(got) == len(tokens) - prompt_len
        assert all(v == NGRAM_NONE or decode_trace_value(v)[1] <= k for v in got)


def test_trace_edges():
    assert NGRAM_TRACE_K == 16 and NGRAM_NONE == 255
    assert ngram_trace([1, 2, 3], 3, max_n=3, min_n=1) == b""
    assert ngram_trace([], 0, max_n=3, min_n=1) == b""
    # no earlier occurrence until a suffix repeats; then the period matches to the end
    got = [decode_trace_value(v) for v in ngram_trace([7, 7, 7, 7, 7], 0, max_n=2, min_n=1)]
    assert got == [None, None, (1, 3), (2, 2), (3, 1)]  # (match length, matching tokens)
    got = [decode_trace_value(v) for v in ngram_trace([5, 6, 5, 6, 5, 6], 2, max_n=3,
                                                      min_n=2)]
    assert got == [None, None, (2, 2), (3, 1)]
    # the same positions, whatever the prompt length: one index, extended token by token
    toks = [1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4]
    assert ngram_trace(toks, 4, max_n=3, min_n=1) == ngram_trace(toks, 0, max_n=3,
                                                                 min_n=1)[4:]
    with pytest.raises(ValueError, match="k must be"):
        ngram_trace([1], 0, max_n=1, min_n=1, k=255)
    with pytest.raises(ValueError, match="min_n"):
        ngram_trace([1], 0, max_n=1, min_n=2)


def test_a_shorter_block_accepts_the_trace_value_capped():
    """The premise of replay: a proposal of k' is the first k' tokens of the proposal of 16."""
    rng = random.Random(3)
    toks = [rng.randrange(3) for _ in range(60)]
    ix = NgramIndex(toks, max_n=3, min_n=1)
    longest = ix.propose(16)[0]
    for k in range(1, 17):
        assert ix.propose(k)[0] == longest[:k]


# -- live requests -----------------------------------------------------------------------------
def _first_positions(stats):
    """(k, accepted, proposer, first generated position) of every iteration."""
    pos = 0
    for k, m, used in zip(stats.k_schedule, stats.accepted_schedule, stats.proposer_schedule,
                          strict=True):
        yield k, m, used, pos
        pos += m + 1


@pytest.mark.parametrize("policy, ngram", [("hybrid:4:1", None),
                                           ("hybrid:6:2", {"max_n": 4, "min_n": 2})])
def test_a_hybrid_request_logs_its_proposers_and_an_exact_trace(models, tmp_path, monkeypatch,
                                                                policy, ngram):
    threads = []
    real = telemetry.ngram_trace

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(telemetry, "ngram_trace", spy)
    db = f"sqlite:///{tmp_path / 'h.db'}"
    spec = autospec.Controller(*models, store=db, policy=policy, ngram=ngram)
    ids = _repetitive(0)
    out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                        do_sample=False, eos_token_id=None)
    st = spec.last_stats
    spec.close()
    # computed once, by the store's writer, not by the request
    assert threads == ["autospec-store-writer"]
    settings = ngram or {"max_n": 3, "min_n": 1}
    assert st.extras["ngram"] == settings and callable(st.traces["ngram"])
    assert st.traces["ngram"]() == ngram_trace(out[0].tolist(), ids.shape[1], **settings)
    with open_store(db) as store, store.session() as s:
        (row,) = queries.recent_requests(s)
    assert set(st.proposer_schedule) == {0, 1}  # both proposers drafted
    assert row.proposer_schedule == bytes(st.proposer_schedule)
    assert row.ngram == {**settings, "drafts": st.proposer("ngram").blocks, "drafted": st.proposer("ngram").proposed,
                         "accepted": st.proposer("ngram").accepted,
                         "accepted_per_position": st.proposer("ngram").accepted_per_position,
                         "drafted_per_position": st.proposer("ngram").proposed_per_position,
                         "lookup_s": pytest.approx(st.ngram_s)}
    assert 0 < st.proposer("ngram").accepted < st.proposer("ngram").proposed
    # the draft model's counters are still its own (they were not logged as the n-gram's)
    assert (row.drafts, row.drafted, row.accepted) == (st.drafts, st.drafted, st.accepted)
    assert len(row.ngram_trace) == st.new_tokens == len(row.trace) == 40
    assert row.ngram_trace == ngram_trace(out[0].tolist(), ids.shape[1], **settings)
    # exactness: every n-gram iteration accepted min(trace at its first position, k)
    checked = 0
    for k, m, used, pos in _first_positions(st):
        if used:
            assert row.ngram_trace[pos] != NGRAM_NONE
            _, agree = decode_trace_value(row.ngram_trace[pos])
            assert m == min(agree, k), (pos, k, m, row.ngram_trace[pos])
            checked += 1
    assert checked == st.proposer("ngram").blocks > 1


def test_the_trace_also_describes_traffic_the_n_gram_never_drafted(models, tmp_path):
    """A draft-model-only request (an int k) still gets its n-gram trace, for replay of the
    proposer choice; no iteration was the n-gram's, so no proposer schedule."""
    db = f"sqlite:///{tmp_path / 'd.db'}"
    spec = autospec.Controller(*models, store=db)
    ids = _repetitive(1)
    out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                        do_sample=False, eos_token_id=None, k=3)
    st = spec.last_stats
    spec.close()
    with open_store(db) as store, store.session() as s:
        (row,) = queries.recent_requests(s)
        (sm,) = queries.category_summaries(s)
    assert st.proposer("ngram").blocks == 0 and not any(st.proposer_schedule)
    assert row.proposer_schedule is None
    assert row.ngram["drafts"] == 0 and row.ngram["drafted_per_position"] == []
    assert row.ngram_trace == ngram_trace(out[0].tolist(), ids.shape[1], max_n=3, min_n=1)
    assert sm.ngram_drafted == 0 and sm.ngram_alpha is None
    assert sm.ngram_acceptance_by_position == () and sm.ngram_lookup_s_per_token is None


def test_category_sums_and_stats_show_the_n_gram(models, tmp_path, capsys):
    from autospec.cli import main

    db = f"sqlite:///{tmp_path / 'c.db'}"
    spec = autospec.Controller(*models, store=db, policy="hybrid:4:1")
    runs = []
    for seed in (0, 2):
        ids = _repetitive(seed)
        spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                      do_sample=False, eos_token_id=None, category="code")
        runs.append(spec.last_stats)
    ids = prompt(10, seed=4)
    spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                  do_sample=False, eos_token_id=None, category="plain", k=2)
    spec.close()
    with open_store(db) as store, store.session() as s:
        sums = {sm.category: sm for sm in queries.category_summaries(s)}
        raw = s.execute(select(CategoryStat).where(CategoryStat.category == "plain")
                        ).scalar_one()
        plain_per_position = raw.ngram_accepted_per_position
    sm = sums["code"]

    def add(name):
        width = max(len(getattr(r, name)) for r in runs)
        return tuple(sum(getattr(r, name)[i] if i < len(getattr(r, name)) else 0
                         for r in runs) for i in range(width))

    assert sm.requests == 2
    assert sm.ngram_drafts == sum(r.ngram_drafts for r in runs) > 0
    assert sm.ngram_drafted == sum(r.ngram_drafted for r in runs)
    assert sm.ngram_accepted == sum(r.ngram_accepted for r in runs)
    assert sm.ngram_accepted_per_position == add("ngram_accepted_per_position")
    assert sm.ngram_drafted_per_position == add("ngram_drafted_per_position")
    assert sm.ngram_lookup_s == pytest.approx(sum(r.ngram_s for r in runs))
    assert sm.drafted == sum(r.drafted for r in runs)  # the draft model's, as before
    assert sm.ngram_alpha == pytest.approx(sm.ngram_accepted / sm.ngram_drafted)
    assert sm.ngram_acceptance_by_position == pytest.approx(
        [a / d for a, d in zip(sm.ngram_accepted_per_position, sm.ngram_drafted_per_position)])
    assert sm.ngram_lookup_s_per_token == pytest.approx(sm.ngram_lookup_s / sm.ngram_drafted)
    # a category the n-gram never drafted: zeros, and NULL per-position lists ("none yet")
    assert sums["plain"].ngram_drafted == 0 and plain_per_position is None

    assert main(["stats", "--db", db]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 100
    header = next(line for line in text.splitlines() if line.startswith("category")
                  and "ngram a" in line)
    assert header.split()[-4:] == ["ngram", "a", "len", "k"]
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split() and line.split()[0] in ("code", "plain") and "[" in line}
    assert rows["code"][-3] == f"{sm.ngram_alpha:.2f}" and rows["plain"][-3] == "-"
    assert "ngram a = the n-gram" in " ".join(text.split())
    assert main(["stats", "--db", db, "--json"]) == 0
    out = {d["category"]: d for d in json.loads(capsys.readouterr().out)}
    assert out["code"]["ngram_drafts"] == sm.ngram_drafts
    assert out["code"]["ngram_accepted"] == sm.ngram_accepted
    assert out["code"]["ngram_acceptance_by_position"] == pytest.approx(
        list(sm.ngram_acceptance_by_position))
    assert out["plain"]["ngram_lookup_s_per_token"] is None


def test_a_batched_request_logs_its_rows_n_gram_record_and_trace(models, tmp_path):
    """The batched loop drafts by n-gram too: each row logs its settings, counters and trace
    as a batch-1 request does (before, batched rows logged none, so neither the n-gram's
    blocks at batch > 1 nor their traces reached the store, the report or replay)."""
    db = f"sqlite:///{tmp_path / 'b.db'}"
    spec = autospec.Controller(*models, store=db, policy="ngram:2")
    ids, mask = _repetitive_batch([8, 6], seed=3)
    spec.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
    live = spec.last_row_stats
    spec.close()
    with open_store(db) as store, store.session() as s:
        rows = sorted(queries.recent_requests(s), key=lambda r: r.prompt_tokens)
        (sm,) = queries.category_summaries(s)
    assert len(rows) == 2 and all(r.batch_size == 2 for r in rows)
    assert sm.ngram_drafts == sum(st.proposer("ngram").blocks for st in live) > 0
    assert sm.ngram_accepted == sum(st.proposer("ngram").accepted for st in live)
    for row, st in zip(rows, sorted(live, key=lambda st: st.prompt_tokens)):
        assert row.ngram["drafted"] == st.proposer("ngram").proposed and row.ngram["max_n"] == DEFAULT_MAX_N
        assert bytes(row.proposer_schedule) == bytes(st.proposer_schedule)
        assert row.ngram_trace == ngram_trace(st.tokens, st.prompt_tokens,
                                              max_n=DEFAULT_MAX_N, min_n=DEFAULT_MIN_N)
        assert len(row.ngram_trace) == st.new_tokens == 12


# -- deferred work --------------------------------------------------------------------------
def _ngram_record(rng, *, finish=None, category="code"):
    rec = make_record(rng, category=category, pair=PAIRS[1])
    rec.ngram = {"max_n": 3, "min_n": 1, "drafts": 2, "drafted": 8, "accepted": 5,
                 "accepted_per_position": [2, 2, 1], "drafted_per_position": [2, 2, 2, 2],
                 "lookup_s": 0.002}
    rec.proposer_schedule = bytes([1] + [0] * (len(rec.k_schedule) - 1))
    rec.ngram_trace = bytes(rng.choice((0, 3, 16, NGRAM_NONE)) for _ in rec.trace)
    rec.finish = finish
    return rec


def test_deferred_work_runs_once_before_validation(tmp_path):
    calls = []

    def finish(rec):
        calls.append(threading.current_thread().name)
        rec.ngram_trace = bytes(len(rec.trace))  # in place: returns None

    rec = _ngram_record(random.Random(1), finish=finish)
    done = validate_record(rec)
    assert calls == ["MainThread"] and done.finish is None
    assert done.ngram_trace == bytes(len(rec.trace))
    replaced = validate_record(_ngram_record(
        random.Random(1), finish=lambda r: _ngram_record(random.Random(2))))
    assert replaced.trace == make_record(random.Random(2), category="code",
                                         pair=PAIRS[1]).trace
    with open_store(tmp_path / "f.db") as store:
        writer = store.writer(flush_interval_s=0.01)
        writer.submit(_ngram_record(random.Random(3), finish=finish))
        assert writer.flush(timeout=10)
        assert calls == ["MainThread", "autospec-store-writer"]
        with store.session() as s:
            (row,) = queries.recent_requests(s)
        assert row.ngram_trace == bytes(len(row.trace))


def test_failing_deferred_work_is_an_invalid_record(tmp_path):
    def broken(rec):
        raise RuntimeError("boom")

    with open_store(tmp_path / "x.db") as store:
        with pytest.raises(ValueError, match="deferred work failed: RuntimeError: boom"):
            store.write([_ngram_record(random.Random(1), finish=broken)])
        writer = store.writer(flush_interval_s=0.01)
        assert writer.submit(_ngram_record(random.Random(2), finish=broken))
        assert writer.submit(_ngram_record(random.Random(3)))
        assert writer.flush(timeout=10)
        stats = writer.stats()
        assert (stats.written, stats.rejected) == (1, 1) and "boom" in stats.last_error
        with store.session() as s:
            assert len(queries.recent_requests(s)) == 1


def test_a_failing_trace_never_reaches_generate(models, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("trace failed")

    monkeypatch.setattr(telemetry, "ngram_trace", broken)
    db = f"sqlite:///{tmp_path / 'g.db'}"
    spec = autospec.Controller(*models, store=db, policy="hybrid:4:1")
    reference = autospec.Controller(*models, store=False, policy="hybrid:4:1")
    ids = _repetitive(2)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
              eos_token_id=None)
    assert torch.equal(spec.generate(ids, **kw), reference.generate(ids, **kw))
    assert spec.writer.flush(timeout=10)
    assert spec.writer.rejected == 1 and spec.store_failures == 0
    spec.close()


@pytest.mark.parametrize("field, value, match", [
    ("proposer_schedule", b"\x01", "one byte per iteration"),
    ("proposer_schedule", bytes([1, 3, 0]), r"2 \(suffix\).*values \[0, 1, 3\]"),
    ("proposer_schedule", "x", "must be bytes"),
    ("ngram_trace", b"\x00", "ngram_trace has 1 bytes"),
    ("ngram", {"max_n": 3, "size": 2}, "unknown keys"),
    ("ngram", {"drafts": -1}, "non-negative int"),
    ("ngram", {"lookup_s": float("nan")}, "finite"),
    ("ngram", {"max_n": 0}, "positive int"),
    ("ngram", [1, 2], "must be a dict"),
])
def test_bad_n_gram_fields_are_refused(field, value, match):
    rec = _ngram_record(random.Random(5))
    rec.k_schedule = rec.accepted_schedule = bytes([2, 2, 2])
    rec.proposer_schedule = bytes([1, 0, 1])
    validate_record(rec)
    setattr(rec, field, value)
    with pytest.raises(ValueError, match=match):
        validate_record(rec)


def test_missing_counters_read_as_zero():
    rec = _ngram_record(random.Random(6))
    rec.ngram = {"drafts": 1}
    got = validate_record(rec).ngram
    assert got == {"max_n": None, "min_n": None, "drafts": 1, "drafted": 0, "accepted": 0,
                   "accepted_per_position": [], "drafted_per_position": [], "lookup_s": 0.0}


# -- sums over any backend, and old databases -------------------------------------------------
def test_category_stats_sum_the_n_gram_over_every_backend(url):
    rng = random.Random(8)
    plain = make_record(rng, category="code", pair=PAIRS[1])  # no n-gram fields at all
    with open_store(url) as store:
        store.write([plain])
        with store.session() as s:
            (before,) = queries.category_summaries(s)
        recs = [_ngram_record(rng) for _ in range(3)]
        recs[1].ngram = dict(recs[1].ngram, accepted_per_position=[1, 1, 1, 1, 1],
                             drafted_per_position=[1, 1, 1, 1, 1, 1])
        store.write(recs[:2])
        store.write(recs[2:])
        with store.session() as s:
            (sm,) = queries.category_summaries(s)
            rows = {r.id: r for r in queries.recent_requests(s)}
    assert before.ngram_drafts == 0 and before.ngram_accepted_per_position == ()
    assert sm.requests == 4
    assert (sm.ngram_drafts, sm.ngram_drafted, sm.ngram_accepted) == (6, 24, 15)
    assert sm.ngram_accepted_per_position == (5, 5, 3, 1, 1)
    assert sm.ngram_drafted_per_position == (5, 5, 5, 5, 1, 1)
    # as the draft model's: positions as far as both lists reach
    assert sm.ngram_acceptance_by_position == pytest.approx([1.0, 1.0, 0.6, 0.2, 1.0])
    assert sm.ngram_lookup_s == pytest.approx(0.006)
    assert sm.ngram_lookup_s_per_token == pytest.approx(0.006 / 24)
    assert sm.to_dict()["ngram_alpha"] == pytest.approx(15 / 24)
    stored = sorted(rows.values(), key=lambda r: r.id)
    assert stored[0].ngram is None and stored[0].ngram_trace is None
    assert [r.ngram_trace for r in stored[1:]] == [r.ngram_trace for r in recs]
    assert [r.proposer_schedule for r in stored[1:]] == [r.proposer_schedule for r in recs]


def test_a_0005_database_is_upgraded_in_place_and_back(url):
    """Rows of an 0005 database read as "not recorded" (NULL) and their category sums as no
    n-gram iterations (0); new rows fold in; downgrading to 0005 drops the columns, keeps the
    rows, and upgrading again works."""
    _create_at(url, "0005")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["pairs", "requests", "category_stats"])
    assert "ngram_trace" not in meta.tables["requests"].c
    assert "ngram_drafts" not in meta.tables["category_stats"].c
    old = make_record(random.Random(9), category="code", pair=PAIRS[1])
    with engine.begin() as conn:
        assert current_revision(conn) == ("0005",)
        pid, _row, dropped = _insert_legacy(conn, meta.tables["requests"], validate_record(old),
                                            ("ngram", "proposer_schedule", "ngram_trace",
                                             "draft_catch_ups", "suffix", "suffix_trace", "decisions"))
        assert set(dropped.values()) == {None}  # nothing of the n-gram: not in schema 0005
        _legacy_stats(conn, meta.tables["category_stats"], pid, [old])
    engine.dispose()

    with open_store(url) as st:
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),)
        with st.session() as s:
            (got,) = queries.recent_requests(s)
            (legacy,) = queries.category_summaries(s)
            raw = s.scalar(select(CategoryStat))
        assert got.ngram is None and got.proposer_schedule is None and got.ngram_trace is None
        assert got.trace == old.trace and got.k_schedule == old.k_schedule
        assert legacy.requests == 1 and legacy.drafted == old.drafted
        assert (legacy.ngram_drafts, legacy.ngram_drafted, legacy.ngram_accepted) == (0, 0, 0)
        assert legacy.ngram_lookup_s == 0.0 and raw.ngram_accepted_per_position is None
        new = _ngram_record(random.Random(10))
        st.write([new])
        with st.session() as s:
            (sm,) = queries.category_summaries(s)
            assert s.scalar(select(Request.ngram_trace).where(
                Request.ngram_trace.is_not(None))) == new.ngram_trace
        assert sm.requests == 2 and sm.ngram_drafted == 8 and sm.ngram_accepted == 5
        assert sm.ngram_accepted_per_position == (2, 2, 1)

    engine = _downgrade(url, "0005")
    insp = inspect(engine)
    assert not {"ngram", "proposer_schedule", "ngram_trace"} & {
        c["name"] for c in insp.get_columns("requests")}
    assert not any(c["name"].startswith("ngram") for c in insp.get_columns("category_stats"))
    engine.dispose()
    with open_store(url) as st, st.session() as s:  # upgraded again: the sums start over
        (sm,) = queries.category_summaries(s)
        assert sm.requests == 2 and sm.ngram_drafted == 0
        assert all(r.ngram is None for r in queries.recent_requests(s))

