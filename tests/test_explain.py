"""A reason for every k: the decision records the engine keeps (``generate(explain=True)``:
every iteration; a store: a sample), where the store keeps them (schema 0009), and what
``autospec explain`` and the report's section 6 make of them (``autospec.policies.explain``)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from sqlalchemy import MetaData, create_engine, inspect
from test_cli_errors import _run
from test_store_batch import _create_at, _downgrade, _insert_legacy

import autospec
from autospec.engine.batch import WHY_EVERY, WHY_FIRST
from autospec.policies import explain
from autospec.report import build_report, render_html, render_json, render_text
from autospec.store import open_store, queries
from autospec.store.migrate import current_revision, head_revision
from autospec.store.write import validate_record

from conftest import noisy_copy, prompt, tiny
from test_store import PAIRS, make_record


@pytest.fixture(scope="module")
def models():
    target = tiny("llama", sharpen=30.0)
    return target, noisy_copy(target, 0.2)


def _check_batch_1(stats):
    """One record per iteration, in order, naming the k and proposer the iteration ran."""
    recs = stats.decisions
    assert [d["iteration"] for d in recs] == list(range(stats.iterations))
    for d, k, who in zip(recs, stats.k_schedule, stats.proposer_schedule, strict=True):
        assert d["format"] == explain.FORMAT and d["batch"] == 1
        assert k <= d["k_run"] <= d["k"]  # a lookup may offer fewer than the clamped k
        if d["proposer_run"] == "draft" and d.get("stop"):  # stopped by the draft's confidence
            assert 1 <= k <= d["k_run"] and who == "draft"
        elif d["proposer_run"] == "draft":
            assert k == d["k_run"] and who == ("draft" if k else None)
        elif k:
            assert who == d["proposer_run"]
        json.dumps(d)  # JSON-ready as it stands


# -- the engine ---------------------------------------------------------------------------------
def test_explain_keeps_one_record_per_iteration_naming_what_it_ran(models):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy="fixed:3")
    spec.generate(prompt(), max_new_tokens=23, do_sample=False, eos_token_id=None,
                  explain=True)
    st = spec.last_stats
    _check_batch_1(st)
    assert all(d["k"] == 3 and d["proposer"] == "draft" and d["rule"] == "policy"
               and d["policy"] == "fixed:3" and d["candidates"] == [] for d in st.decisions)
    assert st.decisions[-1]["k_run"] < 3 == st.decisions[0]["k_run"]  # the tokens left
    # a per-call k and the n-gram proposer: the records follow them
    spec.generate(prompt(seed=3), max_new_tokens=15, do_sample=False, eos_token_id=None,
                  explain=True, k=autospec.policies.Choice(2, "ngram"))
    _check_batch_1(spec.last_stats)
    assert {d["proposer"] for d in spec.last_stats.decisions} == {"ngram"}
    # nobody asks: no record (and none is built)
    spec.generate(prompt(), max_new_tokens=8, do_sample=False)
    assert spec.last_stats.decisions is None
    with pytest.raises(ValueError, match="explain must be True or False"):
        spec.generate(prompt(), max_new_tokens=8, explain="yes")


def test_the_auto_policy_is_explained_too(models):
    """Whatever auto appends (its own record, or none yet: the engine's), one per iteration."""
    target, draft = models
    spec = autospec.Controller(target, draft, store=False)
    spec.generate(prompt(seed=2), max_new_tokens=20, do_sample=False, eos_token_id=None,
                  explain=True, category="code")
    _check_batch_1(spec.last_stats)
    assert all(d["policy"] == spec.policy.name for d in spec.last_stats.decisions)


def test_at_batch_2_one_record_per_iteration_of_the_batch(models):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy="fixed:3")
    ids = torch.cat([prompt(seed=1), prompt(seed=2)])
    spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=14,
                  do_sample=False, eos_token_id=None, explain=True)
    merged, rows = spec.last_stats, spec.last_row_stats
    recs = merged.decisions
    assert [d["iteration"] for d in recs] == list(range(merged.iterations))
    for i, d in enumerate(recs):
        running = [r for r in rows if i < r.iterations]
        assert d["batch"] == len(running) and d["k"] == 3 and d["proposer"] == "draft"
        # each row's block is the batch's k, less where the row has fewer tokens left
        assert max(r.k_schedule[i] for r in running) == d["k_run"]
    for r in rows:  # each row: the records of the iterations it ran in
        assert r.decisions == [d for d in recs if d["iteration"] < r.iterations]


def test_the_store_keeps_a_sample_and_explain_prints_it(models, tmp_path, capsys):
    target, draft = models
    url = f"sqlite:///{tmp_path / 'why.db'}"
    spec = autospec.Controller(target, draft, store=url, policy="fixed:2")
    spec.generate(prompt(), max_new_tokens=70, do_sample=False, eos_token_id=None,
                  category="code")
    sampled = spec.last_stats
    spec.generate(prompt(seed=4), max_new_tokens=12, do_sample=False, eos_token_id=None,
                  category="chat", explain=True)
    every = spec.last_stats
    spec.close()
    keep = [i for i in range(sampled.iterations) if i < WHY_FIRST or i % WHY_EVERY == 0]
    assert sampled.iterations > 2 * WHY_EVERY  # the sample skips some
    assert [d["iteration"] for d in sampled.decisions] == keep
    with open_store(url, read_only=True) as store, store.session() as s:
        first, last = queries.request_decisions(s, 1), queries.latest_decisions(s)
        assert queries.latest_decisions(s, category="code").id == 1
        assert queries.request_decisions(s, 99) is None
    assert first.decisions == sampled.decisions and last.decisions == every.decisions
    assert last.id == 2 and len(last.decisions) == every.iterations

    code, out = _run(["explain", "--db", url, "--last"], capsys)
    assert code == 0, out.err
    assert f"decision records kept for all {every.iterations} iterations" in out.out
    for i in range(every.iterations):
        assert f"iteration {i}: draft k=2  (rule policy, policy fixed:2)" in out.out
    assert explain.RULES["policy"] in out.out  # the legend
    code, out = _run(["explain", "--db", url, "--request", "1"], capsys)
    assert code == 0, out.err
    assert f"{len(keep)} of {sampled.iterations} iterations" in out.out
    assert [int(line.split()[1].rstrip(":")) for line in out.out.splitlines()
            if line.startswith("iteration ")] == keep
    code, out = _run(["explain", "--db", url, "--last", "--category", "code", "--json"], capsys)
    got = json.loads(out.out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert got["request"]["id"] == 1 and got["decisions"] == sampled.decisions
    assert got["request"]["k_schedule"] == sampled.k_schedule


# -- records with candidates: the numbers reproduce the decision ------------------------------
def _auto_record(iteration: int, k: int = 3) -> dict:
    """A record as the cost model writes one: plain and three draft blocks, the best chosen."""
    t1, td = 0.020, 0.004
    cands = [explain.plain(t1)]
    for kk, acc in ((1, [0.8]), (3, [0.8, 0.75, 0.7]), (6, [0.8, 0.75, 0.7, 0.6, 0.5, 0.4])):
        tokens, run = 1.0, 1.0
        for a in acc:
            run *= a
            tokens += run
        block = kk * td + t1 * (1 + 0.05 * kk)
        cands.append(explain.candidate("draft", kk, tokens=tokens, block_s=block,
                                       extra_s=0.0005, speedup=tokens * t1 / block,
                                       saved_s=tokens * t1 - block, acceptance=acc,
                                       acceptance_from="live" if kk < 6 else "prior",
                                       t_propose=td, t_verify=t1 * (1 + 0.05 * kk)))
    best = min(cands, key=lambda c: c["spt"])
    rec = explain.record(autospec.policies.Choice(best["k"], "draft") if best["k"] else 0,
                         "best", cands, t_plain=t1, value=t1)
    rec.update(policy="auto", k_run=rec["k"], proposer_run=rec["proposer"],
               iteration=iteration)
    assert rec["k"] == k
    return rec


def _store_with_auto_records(url):
    rng = random.Random(1)
    recs = []
    for _ in range(3):
        rec = make_record(rng, category="code", pair=PAIRS[1])
        rec.policy = "auto"
        rec.decisions = [_auto_record(i) for i in range(min(3, rec.iterations))]
        recs.append(rec)
    plain = make_record(rng, category="code", pair=PAIRS[1])
    plain.policy = "auto"
    plain.decisions = [{**explain.record(0, "off"), "policy": "auto", "iteration": 0}]
    with open_store(url) as store:
        store.write([*recs, plain])
    return recs


def test_explain_prints_candidates_whose_numbers_reproduce_the_choice(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'auto.db'}"
    recs = _store_with_auto_records(url)
    code, out = _run(["explain", "--db", url, "--request", "1"], capsys)
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert any(line.startswith("iteration 0: draft k=3  (rule best, policy auto)")
               for line in lines)
    chosen = [line for line in lines if line.lstrip().startswith("* draft")]
    assert len(chosen) == len(recs[0].decisions) and all(" 3 " in line for line in chosen)
    assert any("prior" in line for line in lines) and explain.RULES["best"] in out.out
    code, out = _run(["explain", "--db", url, "--request", "1", "--json"], capsys)
    for rec in json.loads(out.out)["decisions"]:
        spts = []
        for c in rec["candidates"]:  # each expected seconds per token from its parts
            assert c["spt"] == pytest.approx((c["block_s"] + c["tokens"] * c["extra_s"])
                                             / c["tokens"])
            spts.append(c["spt"])
        best = rec["candidates"][spts.index(min(spts))]
        assert (best["proposer"], best["k"]) == (rec["proposer"], rec["k"])


def test_explain_says_where_a_block_stopped_by_the_drafts_confidence(tmp_path, capsys):
    """A record whose draft block, priced at k = 3, ran on under a stop rule: explain marks
    the priced candidate, prints the rule's bars, and says why the block ran shorter."""
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    rng = random.Random(3)
    rec = make_record(rng, category="code", pair=PAIRS[1])
    rec.policy = "auto"
    first = _auto_record(0)
    first.update(k=8, k_run=8, stop={"priced_k": 3, "bars": [0.35, 0.35, 0.53], "worth_s": 0.0114,
                                     "accept": [0.5] * 10, "expect": [0.75] * 4,
                                     "extra_s": [0.004] * 3})
    rec.decisions = [first]
    rec.k_schedule = bytes([2]) + bytes(rec.k_schedule[1:])
    with open_store(url) as store:
        store.write([rec])
    code, out = _run(["explain", "--db", url, "--request", "1"], capsys)
    assert code == 0, out.err
    text = " ".join(out.out.split())
    assert "iteration 0: draft k=8 (rule best, policy auto) ran k=2 (stopped where the next " \
           "token stopped paying)" in text
    assert [line for line in out.out.splitlines() if line.lstrip().startswith("* draft")][0] \
        .split()[2] == "3"  # the priced candidate is the chosen row
    assert "bar i (0.35 0.35 0.53; a token worth 11.4 ms, the priced block's ms/tok)" in text


def test_the_report_says_why_auto_ran_its_k(tmp_path):
    url = f"sqlite:///{tmp_path / 'auto.db'}"
    _store_with_auto_records(url)
    with open_store(url, read_only=True) as store:
        report = build_report(store)
    (w,) = report.workloads
    assert (w.why.proposer, w.why.k, w.why.policies) == ("draft", 3, {"auto": w.why.decisions})
    assert w.why.others == {"plain": 1} and w.why.example["candidates"]
    text = render_text(report)
    assert "6. why auto ran draft k=3 on code:" in text and "* draft" in text
    assert "other choices: plain (1)" in text
    assert max(map(len, text.splitlines())) <= 100
    assert "why auto ran draft k=3 on code" in render_html(report)
    got = json.loads(render_json(report))["workloads"][0]["why"]
    assert got["k"] == 3 and got["example"]["candidates"][0]["proposer"] == "plain"


# -- the store ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, match", [
    ([{"k": 1}], "decisions\\[0\\]\\['iteration'\\] must be a non-negative int"),
    ([{"k": 1, "iteration": 0}, {"k": 2, "iteration": 0}], "a second record of iteration 0"),
    ([{"k": -1, "iteration": 0}], "\\['k'\\] must be a non-negative int"),
    ([{"k": 1, "iteration": 0, (1, 2): 1}], "not JSON-ready"),
    ({"k": 1}, "must be a list"),
    (["x"], "decisions\\[0\\] must be a dict"),
])
def test_malformed_decisions_are_refused(value, match):
    rec = make_record(random.Random(2))
    rec.decisions = value
    with pytest.raises(ValueError, match=match):
        validate_record(rec)


def test_values_json_lacks_are_stored_as_what_they_stand_for():
    import numpy as np

    rec = make_record(random.Random(2))
    rec.decisions = [{"k": 1, "iteration": 0, "spt": np.float32(0.5), "where": object,
                      "ks": (1, 2), "inf": float("inf")}]
    (got,) = validate_record(rec).decisions
    assert got["spt"] == 0.5 and got["ks"] == [1, 2] and got["inf"] == float("inf")
    assert got["where"] == str(object)


def test_a_0008_database_is_upgraded_in_place_keeping_its_rows(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    _create_at(url, "0008")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["pairs", "requests"])
    assert "decisions" not in meta.tables["requests"].c
    old = validate_record(make_record(random.Random(3), category="code", pair=PAIRS[1]))
    with engine.begin() as conn:
        _insert_legacy(conn, meta.tables["requests"], old, ("decisions",))
    engine.dispose()
    code, out = _run(["explain", "--db", url, "--last"], capsys)  # read-only: not upgraded
    assert code == 2 and "older than this autospec reads" in out.err
    with open_store(url) as st:
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),) == ("0012",)
        new = make_record(random.Random(4), category="code", pair=PAIRS[1])
        new.decisions = [_auto_record(0)]
        st.write([new])
        with st.session() as s:
            rows = queries.recent_requests(s)[::-1]
            assert [queries.request_decisions(s, r.id).decisions for r in rows] == [
                None, new.decisions]
    assert (rows[0].k_schedule, rows[0].trace, rows[0].new_tokens) == (
        old.k_schedule, old.proposers["draft"].trace, old.new_tokens)  # what was logged is kept
    code, out = _run(["explain", "--db", url, "--request", str(rows[0].id)], capsys)
    assert code == 2 and "has no decision records" in out.err and "explain=True" in out.err
    _downgrade(url, "0008").dispose()
    cols = {c["name"] for c in inspect(create_engine(url)).get_columns("requests")}
    assert "decisions" not in cols and "suffix_trace" in cols


# -- what a person sees for bad input ---------------------------------------------------------
def test_bad_input_is_one_error_line(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'e.db'}"
    with open_store(url) as store:
        store.write([make_record(random.Random(5), category="code", pair=PAIRS[1])])
    cases = [
        (["explain", "--db", url, "--request", "7"], "no request 7 in"),
        (["explain", "--db", url, "--last"], "no request has decision records"),
        (["explain", "--db", url, "--last", "--category", "chat"], "no request of category"),
        (["explain", "--db", url, "--request", "1", "--category", "chat"],
         "request 1 is of category 'code', not 'chat'"),
        (["explain", "--db", str(tmp_path / "none.db"), "--last"], "no store at"),
        (["explain", "--db", "nosuchdialect://x/y", "--last"], "unknown database kind"),
        (["explain", "--db", url], "one of the arguments --request --last is required"),
        (["explain", "--db", url, "--last", "--request", "1"], "not allowed with"),
        (["explain", "--db", url, "--request", "x"], "expected an integer, got 'x'"),
    ]
    for argv, says in cases:
        code, out = _run(argv, capsys)
        assert code == 2, argv
        assert out.err.startswith("autospec: error: ") and out.err.count("\n") == 1, out.err
        assert says in out.err and "Traceback" not in out.err, (argv, out.err)


def test_a_live_auto_run_is_explained_and_its_records_reproduce_its_decisions(models, tmp_path,
                                                                                capsys):
    """The done-when: `autospec explain` on a request of a real run names each iteration's
    choice and its alternatives' expected seconds per token, and its figures reproduce the
    decision (recomputed from the printed record alone, by ``test_explain_record.recompute``)."""
    from test_explain_record import recompute

    target, draft = models
    url = f"sqlite:///{tmp_path / 'live.db'}"
    spec = autospec.Controller(target, draft, store=url, suffix=True)
    for seed in range(3):
        spec.generate(prompt(seed=seed), max_new_tokens=48, do_sample=False,
                      eos_token_id=None, explain=True, category="code")
    spec.close()
    code, out = _run(["explain", "--db", url, "--last", "--json"], capsys)
    assert code == 0, out.err
    records = json.loads(out.out)["decisions"]
    assert [r["iteration"] for r in records] == list(range(len(records)))
    priced = [r for r in records if r["rule"] in ("best", "off")]
    assert priced, f"no priced decision among the rules {[r['rule'] for r in records]}"
    for r in priced:
        assert r["candidates"][0]["proposer"] == "plain"
        assert {c["proposer"] for c in r["candidates"][1:]} <= {"draft", "ngram", "suffix"}
        # a draft block run on past its priced k names the priced one (``stop``)
        assert recompute(r) == ((r.get("stop") or {}).get("priced_k", r["k"]), r["proposer"])
    code, out = _run(["explain", "--db", url, "--last"], capsys)
    assert code == 0 and out.out.count("iteration ") >= len(records)
