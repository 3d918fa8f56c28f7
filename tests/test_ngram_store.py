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
from sqlalchemy import MetaData, create_engine, func, inspect, select
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
from autospec.store.record import ProposerRecord
from autospec.store.tables import CategoryProposer, CategoryStat, RequestProposer
from autospec.store.write import validate_record

from conftest import noisy_copy, prompt, tiny
from records import lookup
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
    assert {"draft", "ngram"} <= set(st.proposer_schedule) <= {"draft", "ngram", None}
    assert row.proposer_schedule == st.proposer_schedule  # both proposers drafted
    ng, live = row.proposers["ngram"], st.proposer("ngram")
    assert (ng.kind, ng.settings) == ("lookup", settings)
    assert (ng.blocks, ng.proposed, ng.accepted) == (live.blocks, live.proposed, live.accepted)
    assert list(ng.accepted_per_position) == live.accepted_per_position
    assert list(ng.proposed_per_position) == live.proposed_per_position
    assert ng.seconds == pytest.approx(live.seconds) and ng.seconds > 0
    assert 0 < live.accepted < live.proposed
    # the draft model's counters are still its own (they were not logged as the n-gram's)
    assert (row.drafts, row.drafted, row.accepted) == (st.drafts, st.drafted, st.accepted)
    assert row.proposers["draft"].blocks == st.proposer_schedule.count("draft")
    assert len(ng.trace) == st.new_tokens == len(row.trace) == 40
    assert ng.trace == ngram_trace(out[0].tolist(), ids.shape[1], **settings)
    # exactness: every n-gram iteration accepted min(trace at its first position, k)
    checked = 0
    for k, m, used, pos in _first_positions(st):
        if used == "ngram":
            assert ng.trace[pos] != NGRAM_NONE
            _, agree = decode_trace_value(ng.trace[pos])
            assert m == min(agree, k), (pos, k, m, ng.trace[pos])
            checked += 1
    assert checked == live.blocks > 1


def test_the_trace_also_describes_traffic_the_n_gram_never_drafted(models, tmp_path):
    """A draft-model-only request (an int k) still gets its n-gram trace, for replay of the
    proposer choice; no iteration was the n-gram's, so its counters are zeros and the
    schedule names only the draft model."""
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
    assert st.proposer("ngram").blocks == 0 and "ngram" not in st.proposer_schedule
    assert row.proposer_schedule == ["draft"] * st.iterations
    ng = row.proposers["ngram"]
    assert ng.blocks == 0 and ng.proposed_per_position == ()
    assert ng.trace == ngram_trace(out[0].tolist(), ids.shape[1], max_n=3, min_n=1)
    assert ng.settings == {"max_n": 3, "min_n": 1}
    sums = sm.proposers["ngram"]
    assert sums.proposed == 0 and sums.alpha is None
    assert sums.acceptance_by_position == () and sums.seconds_per_token is None
    assert sm.drafted == st.drafted > 0  # the headline figures are the draft model's


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
        cp = CategoryProposer
        raw = {(r.category, r.proposer): r for r in s.execute(
            select(CategoryStat.category, cp.proposer, cp.blocks, cp.proposed, cp.accepted,
                   cp.proposed_per_position, cp.accepted_per_position)
            .join(CategoryStat, (CategoryStat.category_key == cp.category_key)
                  & (CategoryStat.pair_id == cp.pair_id)))}
    sm, ng = sums["code"], sums["code"].proposers["ngram"]

    def add(name):
        lists = [getattr(r.proposer("ngram"), name) for r in runs]
        width = max(len(v) for v in lists)
        return tuple(sum(v[i] if i < len(v) else 0 for v in lists) for i in range(width))

    assert sm.requests == 2
    assert ng.kind == "lookup" and ng.blocks == sum(r.proposer("ngram").blocks
                                                   for r in runs) > 0
    assert ng.proposed == sum(r.proposer("ngram").proposed for r in runs)
    assert ng.accepted == sum(r.proposer("ngram").accepted for r in runs)
    assert ng.accepted_per_position == add("accepted_per_position")
    assert ng.proposed_per_position == add("proposed_per_position")
    assert ng.seconds == pytest.approx(sum(r.proposer("ngram").seconds for r in runs))
    assert sm.drafted == sum(r.drafted for r in runs)  # the draft model's, as before
    assert sm.drafted == sm.proposers["draft"].proposed != ng.proposed
    assert ng.alpha == pytest.approx(ng.accepted / ng.proposed)
    assert ng.acceptance_by_position == pytest.approx(
        [a / d for a, d in zip(ng.accepted_per_position, ng.proposed_per_position)])
    assert ng.seconds_per_token == pytest.approx(ng.seconds / ng.proposed)
    # the stored rows are these sums; a category the n-gram never drafted: zeros, empty
    # per-position lists
    assert raw["code", "ngram"].proposed == ng.proposed
    assert raw["code", "ngram"].accepted_per_position == list(ng.accepted_per_position)
    plain = raw["plain", "ngram"]
    assert sums["plain"].proposers["ngram"].proposed == 0 == plain.blocks == plain.accepted
    assert plain.accepted_per_position == plain.proposed_per_position == []

    assert main(["stats", "--db", db]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 100
    header = next(line for line in text.splitlines() if line.startswith("category")
                  and "lookups a" in line)
    assert header.split()[-4:] == ["lookups", "a", "len", "k"]
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split() and line.split()[0] in ("code", "plain") and "[" in line}
    assert rows["code"][-4:-2] == ["ngram", f"{ng.alpha:.2f}"] and rows["plain"][-3] == "-"
    assert "lookups a = each lookup proposer's" in " ".join(text.split())
    assert main(["stats", "--db", db, "--json"]) == 0
    out = {d["category"]: d["proposers"] for d in json.loads(capsys.readouterr().out)}
    assert out["code"]["ngram"]["blocks"] == ng.blocks
    assert out["code"]["ngram"]["accepted"] == ng.accepted
    assert out["code"]["ngram"]["alpha"] == pytest.approx(ng.alpha)
    assert out["code"]["ngram"]["acceptance_by_position"] == pytest.approx(
        list(ng.acceptance_by_position))
    assert out["code"]["ngram"]["seconds_per_token"] == pytest.approx(ng.seconds_per_token)
    assert out["code"]["draft"]["proposed"] == sm.drafted
    assert out["plain"]["ngram"]["seconds_per_token"] is None


def test_a_batched_request_logs_its_rows_n_gram_record_and_trace(models, tmp_path):
    """The batched loop drafts by n-gram too: each row logs its settings, counters and trace
    as a batch-1 request does (before, batched rows logged none, so neither the n-gram's
    blocks at batch > 1 nor their traces reached the store, the report or replay)."""
    db = f"sqlite:///{tmp_path / 'b.db'}"
    spec = autospec.Controller(*models, store=db, policy="ngram:2")
    ids, mask = _repetitive_batch([8, 6], seed=3)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
    live = spec.last_row_stats
    spec.close()
    # each row's tokens: its prompt (left-padded) and its 12 new tokens
    tokens = {int(m.sum()): o[len(m) - int(m.sum()):].tolist() for o, m in zip(out, mask)}
    with open_store(db) as store, store.session() as s:
        rows = sorted(queries.recent_requests(s), key=lambda r: r.prompt_tokens)
        (sm,) = queries.category_summaries(s)
    assert len(rows) == 2 and all(r.batch_size == 2 for r in rows)
    assert len({r.batch_id for r in rows}) == 1 and rows[0].batch_id is not None
    ng = sm.proposers["ngram"]
    assert ng.blocks == sum(st.proposer("ngram").blocks for st in live) > 0
    assert ng.accepted == sum(st.proposer("ngram").accepted for st in live)
    for row, st in zip(rows, sorted(live, key=lambda st: st.prompt_tokens)):
        mine = row.proposers["ngram"]
        assert mine.proposed == st.proposer("ngram").proposed
        assert mine.settings["max_n"] == DEFAULT_MAX_N
        assert row.proposer_schedule == st.proposer_schedule
        assert "ngram" in row.proposer_schedule
        assert mine.trace == ngram_trace(tokens[st.prompt_tokens], st.prompt_tokens,
                                         max_n=DEFAULT_MAX_N, min_n=DEFAULT_MIN_N)
        assert len(mine.trace) == st.new_tokens == 12


# -- deferred work --------------------------------------------------------------------------
def _ngram_record(rng, *, finish=None, category="code"):
    """A draft-model request whose first iteration prompt lookup drafted: its row beside the
    draft model's (counters, settings, host seconds, a trace of one byte per position)."""
    rec = make_record(rng, category=category, pair=PAIRS[1])
    rec.proposers.update(lookup(
        "ngram", settings={"max_n": 3, "min_n": 1}, blocks=2, proposed=8, accepted=5,
        accepted_per_position=[2, 2, 1], proposed_per_position=[2, 2, 2, 2], seconds=0.002,
        trace=bytes(rng.choice((0, 3, 16, NGRAM_NONE)) for _ in range(rec.new_tokens))))
    rec.proposer_schedule = ["ngram"] + ["draft"] * (len(rec.k_schedule) - 1)
    rec.finish = finish
    return rec


def test_deferred_work_runs_once_before_validation(tmp_path):
    calls = []

    def finish(rec):
        calls.append(threading.current_thread().name)
        rec.proposers["ngram"].trace = bytes(rec.new_tokens)  # in place: returns None

    rec = _ngram_record(random.Random(1), finish=finish)
    done = validate_record(rec)
    assert calls == ["MainThread"] and done.finish is None
    assert done.proposers["ngram"].trace == bytes(rec.new_tokens)
    replaced = validate_record(_ngram_record(
        random.Random(1), finish=lambda r: _ngram_record(random.Random(2))))
    assert replaced.proposers["draft"].trace == make_record(
        random.Random(2), category="code", pair=PAIRS[1]).proposers["draft"].trace
    # a proposer's trace given as a callable is deferred work too: run once, then bytes
    traced = []
    lazy = _ngram_record(random.Random(4))
    want = lazy.proposers["ngram"].trace
    lazy.proposers["ngram"].trace = lambda: traced.append(1) or want
    assert validate_record(lazy).proposers["ngram"].trace == want and traced == [1]
    with open_store(tmp_path / "f.db") as store:
        writer = store.writer(flush_interval_s=0.01)
        writer.submit(_ngram_record(random.Random(3), finish=finish))
        assert writer.flush(timeout=10)
        assert calls == ["MainThread", "autospec-store-writer"]
        with store.session() as s:
            (row,) = queries.recent_requests(s)
        assert row.proposers["ngram"].trace == bytes(row.new_tokens)


def _broken_trace():
    raise RuntimeError("boom")


def test_failing_deferred_work_is_an_invalid_record(tmp_path):
    def broken(rec):
        raise RuntimeError("boom")

    lazy = _ngram_record(random.Random(4))
    lazy.proposers["ngram"].trace = _broken_trace
    with pytest.raises(ValueError, match="deferred work failed: RuntimeError: boom"):
        validate_record(lazy)
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


def _set(where: str, field: str, value):
    """A change to a valid record: one field of the record, or of its n-gram row."""
    def change(rec):
        setattr(rec if where == "record" else rec.proposers[where], field, value)
    return change


def _second_model(rec):
    rec.proposers["eagle"] = ProposerRecord(kind="model")


def _bad_name(rec):
    rec.proposers["n-gram"] = rec.proposers.pop("ngram")
    rec.proposer_schedule = None


def _not_a_row(rec):
    rec.proposers["ngram"] = {"blocks": 2}


@pytest.mark.parametrize("change, match", [
    (_set("record", "proposer_schedule", ["ngram"]),
     r"one proposer \(or None\) per iteration \(3\), got 1"),
    (_set("record", "proposer_schedule", ["ngram", "suffix", None]),
     r"names \['suffix'\].*it has draft, ngram"),
    (_set("record", "proposer_schedule", "xyz"), "must be a list of proposer names"),
    (_set("record", "proposer_schedule", [1, 0, 1]), "must be a list of proposer names"),
    (_set("ngram", "trace", b"\x00"), r"proposers\['ngram'\]\.trace has 1 bytes"),
    (_set("ngram", "trace", b""), r"proposers\['ngram'\]\.trace is empty for"),
    (_set("draft", "trace", b""), r"proposers\['draft'\]\.trace is empty for"),
    (_set("ngram", "kind", "oracle"), "kind must be one of"),
    (_set("ngram", "blocks", -1), "non-negative int"),
    (_set("ngram", "seconds", float("nan")), "finite"),
    (_set("ngram", "accepted", 9), "9 ngram tokens accepted of 8 drafted"),
    (_set("ngram", "accepted_per_position", [3, 2]), "3 ngram tokens accepted of 2 drafted"),
    (_set("ngram", "settings", [1, 2]), "settings must be a dict"),
    (_set("ngram", "settings", {"max_n": float("nan")}), "settings must be JSON"),
    (_set("ngram", "settings", {"index": object()}), "settings must be JSON"),
    (_set("record", "proposers", [1, 2]), "proposers must be a dict"),
    (_not_a_row, "must be a ProposerRecord"),
    (_bad_name, "ASCII identifier"),
    (_second_model, "at most one model proposer"),
], ids=lambda x: "" if callable(x) else x)
def test_bad_proposer_fields_are_refused(change, match):
    rec = _ngram_record(random.Random(5))
    rec.k_schedule = rec.accepted_schedule = bytes([2, 2, 2])
    rec.proposer_schedule = ["ngram", None, "draft"]
    assert rec.new_tokens > 1
    validate_record(rec)
    change(rec)
    with pytest.raises(ValueError, match=match):
        validate_record(rec)


def test_missing_counters_read_as_zero(tmp_path):
    rec = _ngram_record(random.Random(6))
    rec.proposers["ngram"] = ProposerRecord(kind="lookup", proposed_per_position=None,
                                            accepted_per_position=None)
    rec.proposer_schedule = None
    got = validate_record(rec).proposers["ngram"]
    assert got == ProposerRecord(kind="lookup", blocks=0, proposed=0, accepted=0,
                                 proposed_per_position=[], accepted_per_position=[],
                                 seconds=0.0, trace=None, confidence=None, settings=None)
    with open_store(tmp_path / "z.db") as store:
        store.write([rec])
        with store.session() as s:
            (row,) = queries.recent_requests(s)
            (sm,) = queries.category_summaries(s)
    stored = row.proposers["ngram"]
    assert (stored.blocks, stored.proposed, stored.accepted, stored.seconds) == (0, 0, 0, 0.0)
    assert stored.trace is None and stored.proposed_per_position == ()
    assert sm.proposers["ngram"].proposed == 0 and sm.proposers["ngram"].alpha is None


# -- sums over any backend, and old databases -------------------------------------------------
def test_category_stats_sum_the_n_gram_over_every_backend(url):
    rng = random.Random(8)
    plain = make_record(rng, category="code", pair=PAIRS[1])  # the draft model alone
    with open_store(url) as store:
        store.write([plain])
        with store.session() as s:
            (before,) = queries.category_summaries(s)
        recs = [_ngram_record(rng) for _ in range(3)]
        recs[1].proposers["ngram"].accepted_per_position = [1, 1, 1, 1, 1]
        recs[1].proposers["ngram"].proposed_per_position = [1, 1, 1, 1, 1, 1]
        store.write(recs[:2])
        store.write(recs[2:])
        with store.session() as s:
            (sm,) = queries.category_summaries(s)
            stored = sorted(queries.recent_requests(s), key=lambda r: r.id)
            rows = queries.request_proposers(s, [r.id for r in stored])
    assert "ngram" not in before.proposers and before.drafted == plain.proposers[
        "draft"].proposed
    ng = sm.proposers["ngram"]
    assert sm.requests == 4 and ng.kind == "lookup"
    assert (ng.blocks, ng.proposed, ng.accepted) == (6, 24, 15)
    assert ng.accepted_per_position == (5, 5, 3, 1, 1)
    assert ng.proposed_per_position == (5, 5, 5, 5, 1, 1)
    # as the draft model's: positions as far as both lists reach
    assert ng.acceptance_by_position == pytest.approx([1.0, 1.0, 0.6, 0.2, 1.0])
    assert ng.seconds == pytest.approx(0.006)
    assert ng.seconds_per_token == pytest.approx(0.006 / 24)
    assert sm.to_dict()["proposers"]["ngram"]["alpha"] == pytest.approx(15 / 24)
    # the draft model's sums are its own, over all four requests
    assert sm.drafted == sum(r.proposers["draft"].proposed for r in [plain, *recs])
    assert set(rows[stored[0].id]) == {"draft"}  # no n-gram row for the request without one
    assert [rows[r.id]["ngram"].trace for r in stored[1:]] == [
        r.proposers["ngram"].trace for r in recs]
    assert [rows[r.id]["ngram"].settings for r in stored[1:]] == [{"max_n": 3, "min_n": 1}] * 3
    assert [r.proposer_schedule for r in stored[1:]] == [r.proposer_schedule for r in recs]


def test_a_0005_database_is_upgraded_in_place_and_back(url):
    """Rows of an 0005 database read as the draft model's alone (no n-gram row: nothing of it
    was recorded) and their category sums as no n-gram iterations; new rows fold in;
    downgrading to 0005 drops the n-gram's columns and the proposer rows, keeps the rows
    and the draft model's counters, and upgrading again works."""
    _create_at(url, "0005")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["pairs", "requests", "category_stats"])
    assert "ngram_trace" not in meta.tables["requests"].c
    assert "ngram_drafts" not in meta.tables["category_stats"].c
    old = validate_record(make_record(random.Random(9), category="code", pair=PAIRS[1]))
    with engine.begin() as conn:
        assert current_revision(conn) == ("0005",)
        pid, _row, dropped = _insert_legacy(conn, meta.tables["requests"], old,
                                            ("ngram", "proposer_schedule", "ngram_trace",
                                             "draft_catch_ups", "suffix", "suffix_trace",
                                             "decisions"))
        assert set(dropped.values()) == {None}  # nothing of the n-gram: not in schema 0005
        _legacy_stats(conn, meta.tables["category_stats"], pid, [old])
    engine.dispose()

    def ngram_rows(s, table):
        return s.scalar(select(func.count()).select_from(table)
                        .where(table.proposer == "ngram"))

    with open_store(url) as st:
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),)
        with st.session() as s:
            (got,) = queries.recent_requests(s)
            (legacy,) = queries.category_summaries(s)
            assert ngram_rows(s, RequestProposer) == ngram_rows(s, CategoryProposer) == 0
        assert set(got.proposers) == {"draft"} and "ngram" not in legacy.proposers
        # every iteration that drafted was the draft model's (0005 had no other proposer)
        assert got.proposer_schedule == ["draft" if k else None for k in old.k_schedule]
        assert got.trace == old.proposers["draft"].trace and got.k_schedule == old.k_schedule
        assert legacy.requests == 1 and legacy.drafted == old.proposers["draft"].proposed
        new = _ngram_record(random.Random(10))
        st.write([new])
        with st.session() as s:
            (sm,) = queries.category_summaries(s)
            assert s.scalar(select(RequestProposer.trace).where(
                RequestProposer.proposer == "ngram")) == new.proposers["ngram"].trace
        ng = sm.proposers["ngram"]
        assert sm.requests == 2 and ng.proposed == 8 and ng.accepted == 5
        assert ng.accepted_per_position == (2, 2, 1)

    engine = _downgrade(url, "0005")
    insp = inspect(engine)
    assert not {"ngram", "proposer_schedule", "ngram_trace"} & {
        c["name"] for c in insp.get_columns("requests")}
    assert not any(c["name"].startswith("ngram") for c in insp.get_columns("category_stats"))
    assert not {"request_proposers", "category_proposers"} & set(insp.get_table_names())
    engine.dispose()
    with open_store(url) as st, st.session() as s:  # upgraded again: the n-gram's sums are gone
        (sm,) = queries.category_summaries(s)
        assert sm.requests == 2 and "ngram" not in sm.proposers
        assert sm.drafted == old.proposers["draft"].proposed + new.proposers["draft"].proposed
        assert all(set(r.proposers) == {"draft"} for r in queries.recent_requests(s))
