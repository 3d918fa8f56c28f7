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
    PROPOSER_CODES,
    SUFFIX_TRACE_WIDTH,
    decode_suffix_value,
    encode_trace_value,
    suffix_trace_error,
)

from conftest import tiny
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
             if p == PROPOSER_CODES["suffix"] and k < 8]
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
        if who == PROPOSER_CODES["suffix"]:
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
        t_suffix = queries.suffix_lookup_s_per_token(s, rows[0].pair_id, "sql")
        assert queries.suffix_lookup_s_per_token(s, rows[0].pair_id, "chat") is None
    assert t_suffix == pytest.approx(sum(st.proposer("suffix").seconds for *_, st in served)
                                     / sum(st.proposer("suffix").proposed for *_, st in served))
    checked = 0
    for row, (toks, L, before, st) in zip(rows, served, strict=True):
        assert row.suffix_trace == st.traces.get("suffix") == suffix_trace(toks, L, before, "sql")
        assert row.suffix == {"drafts": st.proposer("suffix").blocks, "drafted": st.proposer("suffix").proposed,
                              "accepted": st.proposer("suffix").accepted,
                              "accepted_per_position": st.proposer("suffix").accepted_per_position,
                              "drafted_per_position": st.proposer("suffix").proposed_per_position,
                              "lookup_s": pytest.approx(st.suffix_s)}
        assert st.suffix_s > 0
        # exactness: every suffix block held min(k asked, its draft) and accepted as traced
        for k, m, pos in _suffix_firsts(st):
            match, agree, size = decode_suffix_value(row.suffix_trace, pos)
            assert k == min(6, size, 29 - pos) and m == min(agree, k), (pos, k, m)
            checked += 1
    assert checked == sum(st.proposer("suffix").blocks for *_, st in served) > 10
    # the repeat found the first request's whole output in the memory: its drafts agree
    # whole, 16 tokens long once the match is (the match grows with the output)
    repeat = _decoded(rows[-1].suffix_trace)
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
    assert rows[0].suffix_trace == rows[1].suffix_trace == alone
    assert spec.suffix_memory.categories()["tools"][0] == 2  # both joined it afterwards


# -- the store --------------------------------------------------------------------------------
def _suffix_record(rng, positions=None):
    rec = make_record(rng, category="sql", pair=PAIRS[1])
    n = len(rec.trace)
    values = []
    for _ in range(n):
        if rng.random() < 0.3:
            values += [NGRAM_NONE, 0]
        else:
            size = rng.randint(1, NGRAM_TRACE_K)
            values += [encode_trace_value(rng.randint(1, 24), rng.randint(0, size)), size]
    rec.suffix_trace = bytes(values)
    rec.suffix = {"drafts": 2, "drafted": 7, "accepted": 5, "accepted_per_position": [2, 2, 1],
                  "drafted_per_position": [2, 2, 2, 1], "lookup_s": 0.0004}
    return rec


def test_a_record_with_a_suffix_trace_round_trips(url):
    recs = [_suffix_record(random.Random(i)) for i in range(3)]
    recs[2].suffix = recs[2].suffix_trace = None  # a call without the suffix proposer
    with open_store(url) as store:
        store.write(recs)
        with store.session() as s:
            rows = queries.recent_requests(s)[::-1]
            traced = list(queries.traces(s))
    assert [r.suffix_trace for r in rows] == [r.suffix_trace for r in recs]
    assert [t.suffix_trace for t in traced] == [r.suffix_trace for r in recs]
    assert rows[0].suffix == recs[0].suffix and rows[2].suffix is None


@pytest.mark.parametrize("field, value, match", [
    ("suffix_trace", b"\x00", "suffix_trace is not a suffix trace of this request: 1 bytes"),
    ("suffix_trace", "x", "must be bytes"),
    ("suffix_trace", "corrupt:none-with-length", "position 1 holds \\(255, 3\\)"),
    ("suffix_trace", "corrupt:agree-past-length", "position 1 holds"),
    ("suffix_trace", "corrupt:long-draft", "position 1 holds"),
    ("suffix", {"drafts": -1}, "suffix\\['drafts'\\] must be a non-negative int"),
    ("suffix", {"max_n": 3}, "suffix has unknown keys \\['max_n'\\]"),
    ("suffix", [1], "suffix must be a dict"),
])
def test_a_malformed_suffix_record_is_refused(field, value, match):
    rec = _suffix_record(random.Random(5))
    validate_record(rec)
    if isinstance(value, str) and value.startswith("corrupt:"):
        bad = bytearray(rec.suffix_trace + bytes(4))[: SUFFIX_TRACE_WIDTH * len(rec.trace)]
        bad[2:4] = {"none-with-length": (NGRAM_NONE, 3),
                    "agree-past-length": (encode_trace_value(2, 5), 4),
                    "long-draft": (encode_trace_value(2, 5), NGRAM_TRACE_K + 1)}[value[8:]]
        value = bytes(bad)
    setattr(rec, field, value)
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
            assert current_revision(conn) == (head_revision(),) == ("0010",)
        new = _suffix_record(random.Random(4))
        st.write([new])
        with st.session() as s:
            got = [(r.suffix, r.suffix_trace) for r in queries.recent_requests(s)]
        assert got == [(new.suffix, new.suffix_trace), (None, None)]  # the old row: not recorded
    _downgrade(url, "0007").dispose()
    insp = inspect(create_engine(url))
    assert not {"suffix", "suffix_trace"} & {c["name"] for c in insp.get_columns("requests")}
    with open_store(url) as st, st.session() as s:  # upgraded again: the columns are back empty
        assert all(r.suffix_trace is None for r in queries.recent_requests(s))
