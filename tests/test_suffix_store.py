"""Suffix decoding's blocks and its trace: what the target scores, and what the store keeps so
that replay can price the suffix proposer (``autospec.suffix.suffix_trace``)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from sqlalchemy import MetaData, create_engine, inspect
from test_store_batch import _create_at, _downgrade, _insert_legacy
from test_suffix import _requests

import autospec
from autospec.ngram import agreement
from autospec.store import open_store, queries
from autospec.store.migrate import current_revision, head_revision
from autospec.store.write import validate_record
from autospec.suffix import SuffixIndex, SuffixMemory, best_of, suffix_trace
from autospec.traces import (
    MATCH_REACH,
    NGRAM_NONE,
    NGRAM_TRACE_K,
    SUFFIX_TRACE_WIDTH,
    decode_suffix_value,
    encode_trace_value,
    suffix_trace_error,
)

from conftest import tiny
from records import lookup
from test_store import BACKENDS, PAIRS, fresh_url, make_record


@pytest.fixture(scope="module")
def target():
    return tiny("llama", layers=2, seed=5)


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


def test_the_target_scores_no_wider_than_the_longest_suffix_draft(target):
    """``"suffix:8"`` where the drafts hold fewer tokens (a short match, its own length rule):
    the target scores each iteration's longest draft + 1 tokens, never 8 + 1."""
    spec = autospec.Controller(target, None, store=False, policy="suffix:8")
    for ids in _requests(3):
        spec.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                      category="sql")
    st = spec.last_stats
    short = [k for k, p in zip(st.k_schedule, st.proposer_schedule)
             if p == "suffix" and k < 8]
    assert short  # drafts shorter than the policy's k
    # one forward per iteration after the prefill, timed under the width it scored
    scored = Counter(k + 1 for k in st.k_schedule[1:])
    assert {n: len(times) for n, times in st.target_s_by_n.items()} == scored


# -- the trace --------------------------------------------------------------------------------
def _brute_suffix_trace(tokens, prompt_len, memory, category, k=NGRAM_TRACE_K):
    """The definition: at each generated position t, ``best_of`` over a fresh index of
    tokens[:t] and the memory; the draft's match, agreement with tokens[t:] and length."""
    out = []
    for t in range(prompt_len, len(tokens)):
        local = SuffixIndex(memory.settings)
        local.add(tokens[:t])
        draft, match = best_of(local, memory, category, tokens[:t], k)
        out.append(None if not match else
                   (min(match, MATCH_REACH), agreement(draft, tokens[t:]), len(draft)))
    return out


def _decoded(trace):
    return [decode_suffix_value(trace, p) for p in range(len(trace) // SUFFIX_TRACE_WIDTH)]


def test_the_trace_is_the_draft_at_every_position_from_the_memory_as_it_stands():
    memory = SuffixMemory()
    rng = random.Random(0)
    earlier = [rng.randrange(4, 40) for _ in range(60)]
    memory.remember("sql", earlier[:10], earlier[10:])
    tokens = earlier[:10] + earlier[10:40] + [rng.randrange(4, 40) for _ in range(30)]
    trace = suffix_trace(tokens, 10, memory, "sql")
    assert len(trace) == SUFFIX_TRACE_WIDTH * 60 and suffix_trace_error(trace, 60) is None
    got = _decoded(trace)
    assert got == _brute_suffix_trace(tokens, 10, memory, "sql")
    # the first 30 generated tokens repeat the earlier output: long drafts, agreeing
    assert all(v is not None and v[1] == v[2] > 0 for v in got[:15])
    # another category's memory is empty: only the request's own text
    assert _decoded(suffix_trace(tokens, 10, memory, "chat")) == _brute_suffix_trace(
        tokens, 10, SuffixMemory(), "chat")
    with pytest.raises(ValueError, match="k must be"):
        suffix_trace(tokens, 10, memory, "sql", k=NGRAM_TRACE_K + 1)


def _suffix_firsts(stats):
    """(k, accepted, first generated position) of every iteration the suffix drafted."""
    pos = 0
    for k, m, who in zip(stats.k_schedule, stats.accepted_schedule, stats.proposer_schedule,
                         strict=True):
        if who == "suffix":
            yield k, m, pos
        pos += m + 1


def test_a_live_request_stores_its_trace_and_its_blocks_accepted_what_it_says(target,
                                                                             tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    spec = autospec.Controller(target, None, store=url, policy="suffix:6")
    memory = []  # the category's memory before each request, as the trace must read it
    served = []
    for ids in _requests(3, seed=2) + _requests(1, seed=2):  # the last repeats the first
        before = SuffixMemory(spec.suffix_memory.settings)
        for prompt_, output in memory:
            before.remember("sql", prompt_, output)
        out = spec.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                            category="sql")
        toks = out[0].tolist()
        served.append((toks, ids.shape[1], before, spec.last_stats))
        memory.append((toks[: ids.shape[1]], toks[ids.shape[1]:]))
    spec.close()
    with open_store(url) as store, store.session() as s:
        rows = queries.recent_requests(s)[::-1]
        # replay prices its lookups at the seconds per token they took
        t_suffix = queries.lookup_seconds_per_token(s, rows[0].pair_id, "sql")["suffix"]
        assert "suffix" not in queries.lookup_seconds_per_token(s, rows[0].pair_id, "chat")
    assert t_suffix == pytest.approx(sum(st.proposer("suffix").seconds for *_, st in served)
                                     / sum(st.proposer("suffix").proposed for *_, st in served))
    checked = 0
    for row, (toks, L, before, st) in zip(rows, served, strict=True):
        stored, live = row.proposers["suffix"], st.proposer("suffix")
        assert stored.trace == st.traces.get("suffix") == suffix_trace(toks, L, before, "sql")
        assert stored.kind == "lookup"
        assert (stored.blocks, stored.proposed, stored.accepted, stored.accepted_per_position,
                stored.proposed_per_position, stored.seconds) == (
            live.blocks, live.proposed, live.accepted, tuple(live.accepted_per_position),
            tuple(live.proposed_per_position), pytest.approx(live.seconds))
        assert live.seconds > 0
        # exactness: every suffix block held min(k asked, its draft) and accepted as traced
        for k, m, pos in _suffix_firsts(st):
            match, agree, size = decode_suffix_value(stored.trace, pos)
            assert k == min(6, size, 29 - pos) and m == min(agree, k), (pos, k, m)
            checked += 1
    assert checked == sum(st.proposer("suffix").blocks for *_, st in served) > 10
    # the repeat found the first request's whole output in the memory: its drafts agree
    # whole, 16 tokens long once the match is (the match grows with the output)
    repeat = _decoded(rows[-1].proposers["suffix"].trace)
    assert all(v[1] == v[2] > 0 for v in repeat[:14]) and repeat[3][2] == NGRAM_TRACE_K


def test_rows_of_one_call_are_traced_against_the_memory_the_call_started_from(target,
                                                                             tmp_path):
    """Two rows of one batched call, the same prompt, in a new category: neither saw the
    other's output while it ran, and neither's trace does."""
    spec = autospec.Controller(target, None, store=f"sqlite:///{tmp_path / 'b.db'}",
                               policy="suffix:4")
    ids = _requests(1, seed=4)[0].repeat(2, 1)
    out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                        do_sample=False, eos_token_id=None, category="tools")
    rows = spec.last_row_stats
    spec.close()
    alone = suffix_trace(out[0].tolist(), ids.shape[1], SuffixMemory(), "tools")
    assert rows[0].traces["suffix"] == rows[1].traces["suffix"] == alone
    assert spec.suffix_memory.categories()["tools"][0] == 2  # both joined it afterwards


# -- the store --------------------------------------------------------------------------------
def _suffix_record(rng, positions=None):
    rec = make_record(rng, category="sql", pair=PAIRS[1])
    n = rec.new_tokens
    values = []
    for _ in range(n):
        if rng.random() < 0.3:
            values += [NGRAM_NONE, 0]
        else:
            size = rng.randint(1, NGRAM_TRACE_K)
            values += [encode_trace_value(rng.randint(1, 24), rng.randint(0, size)), size]
    rec.proposers.update(lookup("suffix", trace=bytes(values), blocks=2, proposed=7,
                                accepted=5, accepted_per_position=[2, 2, 1],
                                proposed_per_position=[2, 2, 2, 1], seconds=0.0004))
    return rec


def _suffix_of(row):
    """A stored request's suffix row as (counters, trace); None without one."""
    p = row.proposers.get("suffix")
    return None if p is None else (
        (p.kind, p.blocks, p.proposed, p.accepted, list(p.accepted_per_position),
         list(p.proposed_per_position), p.seconds), p.trace)


def test_a_record_with_a_suffix_trace_round_trips(url):
    recs = [_suffix_record(random.Random(i)) for i in range(3)]
    del recs[2].proposers["suffix"]  # a call without the suffix proposer
    with open_store(url) as store:
        store.write(recs)
        with store.session() as s:
            rows = queries.recent_requests(s)[::-1]
            traced = list(queries.traces(s))
    assert [_suffix_of(r) for r in rows] == [_suffix_of(r) for r in recs[:2]] + [None]
    assert [t.traces.get("suffix") for t in traced] == [
        recs[0].proposers["suffix"].trace, recs[1].proposers["suffix"].trace, None]
    assert all(t.kinds.get("suffix") == "lookup" for t in traced[:2])
    # the draft model's row beside it, untouched
    assert [r.trace for r in rows] == [r.proposers["draft"].trace for r in recs]


@pytest.mark.parametrize("field, value, match", [
    ("trace", b"\x00", "proposers\\['suffix'\\].trace has 1 bytes"),
    ("trace", "half", "2 per position"),  # one byte a position: a whole number, not its own
    ("trace", "x", "must be bytes"),
    ("trace", "corrupt:none-with-length", "position 1 holds \\(255, 3\\)"),
    ("trace", "corrupt:agree-past-length", "position 1 holds"),
    ("trace", "corrupt:long-draft", "position 1 holds"),
    ("blocks", -1, "proposers\\['suffix'\\].blocks must be a non-negative int"),
    ("settings", [("max_n", 3)], "proposers\\['suffix'\\].settings must be a dict"),
    ("kind", "tree", "proposers\\['suffix'\\].kind must be one of"),
    (None, [1], "proposers\\['suffix'\\] must be a ProposerRecord"),
])
def test_a_malformed_suffix_record_is_refused(field, value, match):
    rec = _suffix_record(random.Random(5))
    validate_record(rec)
    trace, n = rec.proposers["suffix"].trace, rec.new_tokens
    assert n >= 2  # position 1 is there to corrupt
    if value == "half":
        value = trace[::SUFFIX_TRACE_WIDTH]
    elif isinstance(value, str) and value.startswith("corrupt:"):
        bad = bytearray(trace + bytes(4))[: SUFFIX_TRACE_WIDTH * n]
        bad[2:4] = {"none-with-length": (NGRAM_NONE, 3),
                    "agree-past-length": (encode_trace_value(2, 5), 4),
                    "long-draft": (encode_trace_value(2, 5), NGRAM_TRACE_K + 1)}[value[8:]]
        value = bytes(bad)
    if field is None:
        rec.proposers["suffix"] = value
    else:
        setattr(rec.proposers["suffix"], field, value)
    with pytest.raises(ValueError, match=match):
        validate_record(rec)


def test_a_0007_database_is_upgraded_in_place_and_back(url):
    _create_at(url, "0007")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["pairs", "requests"])
    assert "suffix_trace" not in meta.tables["requests"].c
    old = make_record(random.Random(3), category="sql", pair=PAIRS[1])
    with engine.begin() as conn:
        _insert_legacy(conn, meta.tables["requests"], validate_record(old),
                       ("suffix", "suffix_trace", "decisions"))
    engine.dispose()
    with open_store(url) as st:
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),) == ("0012",)
        new = _suffix_record(random.Random(4))
        st.write([new])
        with st.session() as s:
            got = [_suffix_of(r) for r in queries.recent_requests(s)]
        assert got == [_suffix_of(new), None]  # the old row: not recorded
    _downgrade(url, "0007").dispose()
    insp = inspect(create_engine(url))
    assert not {"suffix", "suffix_trace"} & {c["name"] for c in insp.get_columns("requests")}
    with open_store(url) as st, st.session() as s:  # upgraded again: no suffix row is back
        rows = queries.recent_requests(s)
        assert [set(r.proposers) for r in rows] == [{"draft"}, {"draft"}]
        assert [r.trace for r in rows] == [new.proposers["draft"].trace,
                                           old.proposers["draft"].trace]
