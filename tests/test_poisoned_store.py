"""A store holding rows no release writes today — a scrape an older release ingested whose
counters contradict each other (more tokens accepted than drafted), tuned-parameter rows no
policy can be built from — is still read: every reader leaves the row out, names it, and goes
on with the rest. The rows are written straight into the tables with SQLAlchemy, as an older
release or a hostile writer would have, not through the guarded ingest path.

The readers: ``stats``, ``report`` (text, JSON, HTML), ``export`` (every engine, the tuned
source too), ``explain``, ``metrics --backfill``, ``tune``, and serving — a wrapped tiny model
with the policy that follows tuned rows, warm-started from the store. SQLite always,
PostgreSQL too where AUTOSPEC_TEST_POSTGRES_URL is set (as tests/test_store.py)."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from sqlalchemy import insert, select, text, update
from test_report_batch import fill, grid_payload

import autospec
from autospec.cli import main
from autospec.fleet.ingest import SpecCounters, to_record
from autospec.policies.tuned import TunedPolicy
from autospec.store import add_probe, add_tuned_params, damage, open_store, queries
from autospec.store.record import PairInfo
from autospec.store.tables import (
    CategoryProposer,
    Request,
    RequestProposer,
    TunedParams,
    utcnow,
)
from autospec.store.write import category_key, get_or_create_pair, write_records

from conftest import noisy_copy, prompt, tiny
from test_store import BACKENDS, fresh_url, make_record

# what the poisoned scrape says: 50 000 tokens accepted of 400 drafted (12 500 %)
POISON = {"accepted": 50000, "accepted_per_position": [20000, 15000, 10000, 5000]}


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    """Each test starts with nothing logged yet (``damage.note`` logs a message once per
    process)."""
    monkeypatch.setattr(damage, "_LOGGED", set())


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


def poison_scrape(url: str, category: str, pair: PairInfo) -> int:
    """An older release's ingest of a scrape that contradicts itself: the record written as
    ingest writes it (its request row and the category's sums), then the counters set in both
    tables to what the scrape said. Returns the request's id."""
    good = to_record(SpecCounters("m", 100, 400, 300, [100, 90, 70, 40]), category=category,
                     target=pair.target, draft=pair.draft, dtype=pair.dtype,
                     hardware=pair.hardware)
    (name,) = good.proposers  # the engine's drafter: the model proposer's row
    with open_store(url) as st, st.begin() as s:
        write_records(s, [good])
        rid = s.scalar(select(Request.id).order_by(Request.id.desc()).limit(1))
        s.execute(update(RequestProposer).where(RequestProposer.request_id == rid,
                                                RequestProposer.proposer == name)
                  .values(**POISON))
        stat = s.get(CategoryProposer, (category_key(category), get_or_create_pair(s, pair),
                                        name))
        mine = good.proposers[name]
        stat.accepted += POISON["accepted"] - mine.accepted
        stat.accepted_per_position = [
            a + p - g for a, p, g in zip(stat.accepted_per_position,
                                         POISON["accepted_per_position"],
                                         mine.accepted_per_position)]
    return rid


def tuned_row(url: str, pair_id: int, params, *, family: str = "fixed", raw: str | None = None,
              category: str = "code") -> int:
    """A tuned-parameters row written straight into its table; ``raw``: text put in place of
    its parameters afterwards (JSON that does not parse)."""
    with open_store(url) as st, st.begin() as s:
        tid = s.execute(insert(TunedParams).values(
            created_at=utcnow(), category=category, category_key=category_key(category),
            pair_id=pair_id, family=family, params=params, tokens_per_s=10.0,
            baseline_tokens_per_s=9.0, provenance={})).inserted_primary_key[0]
        if raw is not None:
            s.execute(text("UPDATE tuned_params SET params = :raw WHERE id = :id"),
                      {"raw": raw, "id": tid})
    return tid


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def said(err: str) -> list[str]:
    """The `autospec: warning: skipped` lines of a command's stderr."""
    return [ln for ln in err.splitlines() if ln.startswith("autospec: warning: skipped ")]


# -- counters outside [0, 1] --------------------------------------------------------------------
@pytest.fixture
def synthetic(url):
    """"code" traffic on one pair with a probe grid and a tuned table; then one poisoned
    scrape mixed into "code" and one alone in "chat"."""
    with open_store(url) as st:
        fill(st)
        with st.session() as s:
            (before,) = queries.category_summaries(s, category="code")
    pair = PairInfo(before.pair.target, before.pair.draft, before.pair.dtype,
                    before.pair.hardware)
    mixed, alone = poison_scrape(url, "code", pair), poison_scrape(url, "chat", pair)
    return url, before, mixed, alone


def test_a_poisoned_row_is_left_out_of_its_categorys_statistics_and_named(synthetic, capsys):
    url, before, mixed, alone = synthetic
    code, out, err = run(["stats", "--db", url, "--json"], capsys)
    assert code == 0
    (sm,) = json.loads(out)  # "chat" held nothing else: left out whole
    assert sm["category"] == "code"
    assert (sm["requests"], sm["drafted"], sm["accepted"]) == (
        before.requests, before.drafted, before.accepted)
    assert sm["accepted_per_position"] == list(before.accepted_per_position)
    assert sm["proposers"]["draft"]["accepted"] == before.accepted
    lines = said(err)
    assert len(lines) == 2
    assert all("50000 draft tokens accepted of 400 drafted" in ln for ln in lines)
    assert f"request {mixed} (category 'code' on pair 1" in lines[0]
    assert f"request {alone} (category 'chat' on pair 1" in lines[1]
    assert all(ln.endswith("; left out") for ln in lines)
    code, out, err = run(["stats", "--db", url], capsys)
    assert code == 0 and "code" in out and len(said(err)) == 2


def test_every_reader_of_counters_survives_and_names_the_row(synthetic, tmp_path, capsys):
    url, before, mixed, alone = synthetic
    code, out, err = run(["report", "--db", url], capsys)
    assert code == 0 and f"skipped: request {mixed}" in out and not said(err)
    for fmt in ("json", "html"):
        code, out, err = run(["report", "--db", url, "--format", fmt, "--out",
                              str(tmp_path / fmt)], capsys)
        assert code == 0 and len(said(err)) == 2
    code, out, err = run(["report", "--db", url, "--format", "json"], capsys)
    report = json.loads(out)
    assert [w["category"] for w in report["workloads"]] == ["code"]
    assert report["workloads"][0]["acceptance"]["accepted"] == before.accepted
    assert any(f"request {alone}" in n for n in report["skipped"])
    for engine in ("vllm", "sglang", "trtllm", "llamacpp"):
        code, out, err = run(["export", "--db", url, "--engine", engine, "--category", "code"],
                             capsys)
        assert code == 0 and f"skipped request {mixed}" in err, (engine, err)
    code, out, err = run(["export", "--db", url, "--engine", "vllm", "--category", "chat"],
                         capsys)
    assert code == 2 and "damaged row(s) left out" in err and f"request {alone}" in err
    code, out, err = run(["metrics", "--db", url, "--backfill", "-"], capsys)
    assert code == 0 and any(f"request {mixed}" in ln for ln in said(err))
    assert "vllm:spec_decode_num_accepted_tokens" in out
    code, out, err = run(["tune", "--db", url, "--dry-run", "--trials", "2"], capsys)
    assert code in (0, 2) and f"request {mixed}" in err


def test_a_record_whose_counters_contradict_each_other_is_refused_at_write(url):
    rec = make_record(random.Random(3), category="code")
    rec.proposers["draft"].accepted = rec.proposers["draft"].proposed + 1
    with open_store(url) as st:
        with pytest.raises(ValueError, match="contradict each other"):
            st.write([rec])
        with st.session() as s:
            assert queries.category_summaries(s) == []


def test_a_trace_too_short_for_its_request_is_left_out_of_replay_and_named(url, capsys):
    """A request row whose model trace holds fewer bytes than the positions it generated (an
    older release's, or written by hand; the write path refuses one) would have replay read
    past its end: ``traces`` leaves it out and names it, and ``tune`` goes on with the rest.
    An ingested scrape (counters, no trace) is no request to replay: not read either."""
    recs = [make_record(random.Random(i), category="code") for i in range(3)]
    pair = recs[0].pair
    with open_store(url) as st:
        st.write([*recs, to_record(SpecCounters("m", 100, 400, 300, [100, 90, 70, 40]),
                                   category="code", target=pair.target, draft=pair.draft,
                                   dtype=pair.dtype, hardware=pair.hardware)])
        with st.begin() as s:
            short = s.scalar(select(Request.id).order_by(Request.id).limit(1))
            s.execute(update(RequestProposer).where(RequestProposer.request_id == short)
                      .values(trace=b"\x01"))
        with damage.collecting() as notes, st.session() as s:
            ids = [row.id for row in queries.traces(s)]
    assert len(ids) == 2 and short not in ids  # the short one and the scrape left out
    (line,) = notes
    assert f"request {short} " in line and "its draft trace has 1 bytes for" in line
    code, out, err = run(["tune", "--db", url, "--dry-run", "--trials", "2"], capsys)
    assert code in (0, 2) and f"request {short} " in err


def test_the_wilson_interval_refuses_a_proportion_above_one():
    with pytest.raises(ValueError, match="not a proportion"):
        queries.wilson_interval(500, 400)
    assert queries.wilson_interval(400, 400)[1] == pytest.approx(1.0)


# -- tuned rows that cannot be applied ----------------------------------------------------------
DAMAGED = {  # how a tuned row can be damaged → (params, raw text in their place)
    "null": (None, None), "a list": ([1, 2], None), "k 999": ({"k": 999}, None),
    "k -5": ({"k": -5}, None), "not JSON": ({"k": 2}, '{"k": 2'),
}


@pytest.mark.parametrize("damage_kind", DAMAGED)
def test_readers_of_tuned_rows_leave_a_damaged_one_out_and_name_it(url, damage_kind, capsys):
    params, raw = DAMAGED[damage_kind]
    if raw is not None and url.startswith("postgresql"):
        pytest.skip("PostgreSQL's json type refuses text that does not parse")
    with open_store(url) as st:
        fill(st)  # the sound tuned table, row 1
    bad = tuned_row(url, 1, params, raw=raw)
    for argv in (["stats"], ["report", "--format", "json"],
                 ["export", "--engine", "vllm", "--source", "tuned"],
                 ["export", "--engine", "trtllm", "--source", "tuned"]):
        code, out, err = run([*argv, "--db", url], capsys)
        assert code == 0, (argv, err)
        assert any(f"tuned parameters #{bad}" in ln for ln in said(err)), (argv, err)
    assert "tuned policy (table:1-4:3,5-8:1,9-:0)" in out  # the sound row stays in force
    with open_store(url, read_only=True) as st, st.session() as s:
        (row,) = queries.tuned_params(s)
    assert row.id == 1 and row.family == "table"


def test_the_live_tuned_policy_reads_past_damaged_rows_and_logs_each_once(url, caplog):
    pair = PairInfo("t", "d", "bfloat16", "cpu: test")
    with open_store(url) as st:
        with st.begin() as s:
            pid = get_or_create_pair(s, pair)
        first = tuned_row(url, pid, {"k": 2})
        null = tuned_row(url, pid, None)
        policy = TunedPolicy(refresh_s=3600)
        with caplog.at_level(logging.WARNING, logger="autospec.policies.tuned"):
            policy.attach(queries.tuned_fetcher(st, pair))
            assert policy.params["code"].id == first
            newer = tuned_row(url, pid, {"k": 3})  # past the damaged row: applied
            last = tuned_row(url, pid, [3])  # the newest row damaged: the poll reads past it
            for _ in range(3):
                policy.reload()
        policy.close()
    assert policy.params["code"].id == newer and policy.policies()[0].k == 3
    assert policy.reload_failures == 0
    for tid in (null, last):
        assert caplog.text.count(f"ignoring tuned parameters #{tid} ") == 1, caplog.text


# -- the scenario: one poisoned scrape, one corrupt tuned row, every reader -------------
@pytest.fixture
def served(tmp_path):
    """A tiny pair served with the store on (a SQLite file), its costs probed, tuned twice
    (fixed k = 2, then k = 3); between the two a corrupt tuned row, and one poisoned scrape
    ingested by an older release into the served category."""
    url = f"sqlite:///{tmp_path / 'served.db'}"
    target = tiny("llama", sharpen=30.0)
    draft = noisy_copy(target, 0.15)
    spec = autospec.Controller(target, draft, store=url, names=("org/t", "org/d"))
    for seed in range(3):
        spec.generate(prompt(10, seed=seed), max_new_tokens=16, do_sample=False, k=3,
                      category="code", eos_token_id=None)
    spec.close()
    with open_store(url) as st:
        with st.session() as s:
            (before,) = queries.category_summaries(s)
        p = before.pair
        pair = PairInfo(p.target, p.draft, p.dtype, p.hardware)
        with st.begin() as s:
            add_probe(s, pair, grid_payload())
            first = add_tuned_params(s, category="code", pair_id=p.id, family="fixed",
                                     params={"k": 2}, tokens_per_s=10.0,
                                     baseline_tokens_per_s=9.0, provenance={})
    corrupt = tuned_row(url, p.id, {"k": 2}, raw="{not json")
    with open_store(url) as st, st.begin() as s:
        newest = add_tuned_params(s, category="code", pair_id=p.id, family="fixed",
                                  params={"k": 3}, tokens_per_s=11.0,
                                  baseline_tokens_per_s=9.0, provenance={})
    scrape = poison_scrape(url, "code", pair)
    return dict(url=url, models=(target, draft), before=before, first=first,
                corrupt=corrupt, newest=newest, scrape=scrape)


def test_a_poisoned_scrape_and_a_corrupt_tuned_row_leave_every_reader_working(served, capsys):
    url, scrape, corrupt = served["url"], served["scrape"], served["corrupt"]
    both = (f"skipped request {scrape} ", f"skipped tuned parameters #{corrupt} ")

    def names_both(err: str) -> bool:
        lines = said(err)
        return all(any(b in ln for ln in lines) for b in both)

    code, out, err = run(["stats", "--db", url, "--json"], capsys)
    (sm,) = json.loads(out)
    assert code == 0 and names_both(err)
    assert (sm["drafted"], sm["accepted"]) == (served["before"].drafted,
                                               served["before"].accepted)
    code, out, err = run(["report", "--db", url], capsys)
    assert code == 0 and f"skipped: request {scrape} " in out
    assert f"skipped: tuned parameters #{corrupt} " in out
    for fmt in ("json", "html"):
        code, out, err = run(["report", "--db", url, "--format", fmt, "--out",
                              served["url"].removeprefix("sqlite:///") + f".{fmt}.d"], capsys)
        assert code == 0 and names_both(err), fmt
    for engine in ("vllm", "sglang", "trtllm", "llamacpp"):
        for source in ("auto", "tuned"):
            code, out, err = run(["export", "--db", url, "--engine", engine, "--source",
                                  source], capsys)
            assert code == 0 and names_both(err), (engine, source, err)
    code, out, err = run(["export", "--db", url, "--engine", "sglang", "--source", "tuned"],
                         capsys)
    assert "--speculative-num-steps 3" in out  # the newest sound row's k, past the corrupt one
    code, out, err = run(["explain", "--db", url, "--last"], capsys)
    assert code == 0 and "iteration" in out
    code, out, err = run(["metrics", "--db", url, "--backfill", "-"], capsys)
    assert code == 0 and any(f"request {scrape} " in ln for ln in said(err))


def test_serving_warm_starts_and_follows_tuned_rows_past_the_damaged_ones(served, caplog):
    target, draft = served["models"]
    ids = prompt(12, seed=9)
    with caplog.at_level(logging.WARNING):
        spec = autospec.Controller(target, draft, store=served["url"], names=("org/t", "org/d"),
                                   policy="tuned")
        out = spec.generate(ids, max_new_tokens=16, do_sample=False, category="code",
                            eos_token_id=None)
        spec.close()
    assert torch.equal(out, target.generate(ids, max_new_tokens=16, do_sample=False,
                                            eos_token_id=None))
    assert spec.fallbacks == {} and spec.last_stats is not None
    assert spec.policy.params["code"].id == served["newest"]
    assert max(spec.last_stats.k_schedule) == 3  # the newest sound row's fixed k
    assert f"ignoring tuned parameters #{served['corrupt']} for 'code'" in caplog.text
    assert f"request {served['scrape']} " in caplog.text  # the warm start left it out
    assert caplog.text.count(f"request {served['scrape']} ") == 1
