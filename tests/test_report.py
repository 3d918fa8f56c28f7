"""`autospec report` on real SQLite stores: its numbers recomputed from the request rows, its
verdicts on constructed workloads, its formats (text, one self-contained HTML file, JSON),
and a 100k-request store (build time and peak memory printed, never asserted)."""

from __future__ import annotations

import json
import logging
import math
import random
import re
import statistics
import subprocess
import sys
import time
import tracemalloc
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

import pytest

from autospec.cli import build_parser, main
from autospec.report import (
    MIN_DRAFTED,
    build_report,
    render_html,
    render_json,
    render_text,
)
from autospec.store import (
    PairInfo,
    RequestRecord,
    add_probe,
    add_tuned_params,
    open_store,
    write_records,
)
from autospec.store.history import bucket_seconds
from autospec.traces import UNOBSERVED

from records import blocks, draft, lookup

log = logging.getLogger(__name__)

T0 = 1_700_000_000.25  # a fixed epoch (…:20.25 UTC), away from bucket boundaries
FLAT = PairInfo("org/target-7b", "org/draft-0.5b", "bfloat16", "cuda: NVIDIA H200",
                14_000_000_000, 1_000_000_000)
SLOW = PairInfo("org/target-7b", "org/draft-0.5b", "float32", "cpu: 2 threads")


def record(pair: PairInfo, category: str, ks: list[int], accs: list[int], *, t_target,
           t_draft: float = 0.01, created_at: float = T0, policy: str = "costmodel",
           bandwidth: float | None = None) -> RequestRecord:
    """A request whose wall time is exactly what its iterations cost:
    Σ (k·T_d + T_t(k+1)); ``t_target(n)`` gives T_t(n)."""
    by_n: dict[int, list[float]] = defaultdict(list)
    for k in ks:
        by_n[k + 1].append(t_target(k + 1))
    drafted = sum(ks)
    wall = drafted * t_draft + sum(sum(v) for v in by_n.values())
    return RequestRecord(
        pair=pair, category=category, policy=policy, greedy=True, prompt_tokens=10,
        new_tokens=sum(accs) + len(ks), iterations=len(ks),
        proposers=draft(trace=block_trace(ks, accs), **blocks(ks, accs)),
        k_schedule=bytes(ks), accepted_schedule=bytes(accs), wall_s=wall, prefill_s=0.0,
        draft_s=drafted * t_draft, draft_forwards=drafted, target_s_by_n=dict(by_n),
        trace_kind="greedy",
        bandwidth_bytes_per_s=bandwidth, bandwidth_peak_bytes_per_s=4.8e12 if bandwidth
        else None, created_at=created_at, path="eager")


def block_trace(ks: list[int], accs: list[int]) -> bytes:
    """The draft's greedy trace of iterations of ``ks`` tokens with ``accs`` accepted: each
    accepted token agreed, the target's own token after them did not (unobserved where the
    whole block was accepted, or nothing was drafted)."""
    out = bytearray()
    for k, a in zip(ks, accs):
        out += bytes([1]) * a + bytes([0 if a < k else UNOBSERVED])
    return bytes(out)


def accepted_run(rng: random.Random, k: int, alpha: float) -> int:
    """Accepted length of one iteration at lookahead k, constant per-token acceptance."""
    n = 0
    while n < k and rng.random() < alpha:
        n += 1
    return n


def write(store, records, batch: int = 5000) -> None:
    """Through the store's own write path, in batches (records built above are valid)."""
    for i in range(0, len(records), batch):
        with store.begin() as s:
            write_records(s, records[i:i + batch], validated=True)


@pytest.fixture
def store(tmp_path):
    st = open_store(f"sqlite:///{tmp_path / 'r.db'}")
    yield st
    st.close()


def _parse(argv):
    return build_parser().parse_args(argv)


# ---- direct recomputation ---------------------------------------------------------------

def expected(records, bucket_of=None):
    """Per (category, pair): the report's figures recomputed from the request records."""
    out = {}
    for r in sorted(records, key=lambda r: r.created_at):
        e = out.setdefault((r.category, r.pair), defaultdict(
            int, k=Counter(), plain=[0, 0, 0.0], spec=[0, 0, 0.0], buckets=defaultdict(
                lambda: [0, 0, 0]), order=[]))
        e["requests"] += 1
        e["new_tokens"] += r.new_tokens
        e["drafted"] += r.proposers["draft"].proposed
        e["accepted"] += r.proposers["draft"].accepted
        e["k"].update(r.k_schedule)
        e["order"].append(r)
        if r.batch_size != 1:  # measured speedups compare batch-1 requests only
            continue
        mode = e["plain"] if all(k == 0 for k in r.k_schedule) else e["spec"]
        mode[0] += 1
        mode[1] += r.new_tokens
        mode[2] += r.wall_s
    return out


def check_against_rows(rep, records) -> None:
    want = expected(records)
    got = {(w.category, w.pair["dtype"], w.pair["hardware"]): w for w in rep.workloads}
    assert len(got) == len(want)
    for (cat, pair), e in want.items():
        w = got[(cat, pair.dtype, pair.hardware)]
        assert w.traffic.requests == e["requests"]
        assert w.traffic.new_tokens == e["new_tokens"]
        assert w.acceptance.drafted == e["drafted"] and w.acceptance.accepted == e["accepted"]
        if e["drafted"]:
            assert w.acceptance.alpha == pytest.approx(e["accepted"] / e["drafted"])
            lo, hi = w.acceptance.alpha_ci95
            assert lo <= w.acceptance.alpha <= hi
        assert w.policy.k_counts == dict(e["k"])
        for name in ("plain", "spec"):
            n, tok, wall = e[name]
            got_rate = w.speedup.plain if name == "plain" else w.speedup.speculative
            if n == 0:
                assert got_rate is None
                continue
            assert (got_rate.requests, got_rate.new_tokens) == (n, tok)
            assert got_rate.tokens_per_s == pytest.approx(tok / wall, rel=1e-9)
        if e["plain"][0] and e["spec"][0]:
            assert w.speedup.measured == pytest.approx(
                (e["spec"][1] / e["spec"][2]) / (e["plain"][1] / e["plain"][2]), rel=1e-9)
        # α over time: the report's buckets, recomputed from the rows
        b = w.history_bucket_s
        assert b == bucket_seconds(w.traffic.first_seen, w.traffic.last_seen)
        buckets: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in e["order"]:
            cell = buckets[math.floor(r.created_at / b)]
            cell[0] += 1
            cell[1] += r.proposers["draft"].proposed
            cell[2] += r.proposers["draft"].accepted
        assert [(h["start"].timestamp(), h["requests"], h["drafted"], h["accepted"])
                for h in w.history] == [(i * b, *v) for i, v in sorted(buckets.items())]
        for h in w.history:
            assert h["alpha"] == (h["accepted"] / h["drafted"] if h["drafted"] else None)
        # the policy in force: the latest batch-1 requests
        order = [r for r in e["order"] if r.batch_size == 1]
        latest = order[::-1][:w.policy.recent_requests]
        assert w.policy.recent_requests == min(200, len(order))
        assert w.policy.policies == dict(Counter(r.policy for r in latest))
        assert w.policy.recent_k_counts == dict(Counter(k for r in latest
                                                        for k in r.k_schedule))


def check_formats(rep, tmp_path=None) -> tuple[str, str, dict]:
    text, html, js = render_text(rep), render_html(rep), json.loads(render_json(rep))
    # HTML: one file, inline SVG per workload, nothing fetched
    assert html.startswith("<!DOCTYPE html>") and html.endswith("</html>")
    assert html.count("<svg") >= 4 * len(rep.workloads)
    assert html.count("<svg") == html.count("</svg>")
    assert not re.search(r"(src|href)\s*=", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html.lower() and "@import" not in html and "url(" not in html
    for svg in re.findall(r"<svg\b.*?</svg>", html, re.S):  # each chart is well-formed XML
        ET.fromstring(svg)
    # text: fits a terminal; read with its lines joined (long sentences wrap)
    assert max(map(len, text.splitlines())) <= 100
    flat = " ".join(text.split())
    # JSON: the same numbers as the dataclasses, and as the text shows them
    assert len(js["workloads"]) == len(rep.workloads)
    for w, j in zip(rep.workloads, js["workloads"]):
        assert j["traffic"]["requests"] == w.traffic.requests
        assert j["acceptance"]["alpha"] == w.acceptance.alpha
        assert j["speedup"]["value"] == w.speedup.value
        assert j["verdict"]["text"] == w.verdict.text
        assert {int(k): v for k, v in j["policy"]["k_counts"].items()} == w.policy.k_counts
        assert j["verdict"]["text"] in flat and w.verdict.text in html.replace("&#x27;", "'")
        if j["acceptance"]["alpha"] is not None:
            assert f"{j['acceptance']['alpha']:.3f}" in text
        if j["speedup"]["value"] is not None:
            assert f"{j['speedup']['value']:.2f}×" in text
        assert f"{j['traffic']['requests']} requests" in text
    return text, html, js


# ---- tests ------------------------------------------------------------------------------

def test_empty_store_says_there_is_no_traffic(store, tmp_path, capsys):
    rep = build_report(store)
    assert rep.workloads == []
    text, html, js = check_formats(rep)
    assert "no traffic" in text and "No traffic" in html and js["workloads"] == []
    url = f"sqlite:///{tmp_path / 'r.db'}"
    assert main(["report", "--db", url]) == 0
    assert "no traffic" in capsys.readouterr().out


def test_one_request(store):
    nasty = "code <script>alert(\"x\")</script> & 'q'\n" + "é" * 300  # escaped everywhere
    rec = record(FLAT, nasty, [4, 4, 4], [4, 2, 0], t_target=lambda n: 0.1)
    write(store, [rec])
    rep = build_report(store)
    (w,) = rep.workloads
    assert w.verdict.kind == "not_enough"
    assert w.verdict.text == "not enough traffic yet (12 drafted tokens)"
    assert w.acceptance.by_position == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    assert w.speedup.measured is None and w.speedup.estimated is None  # no T_t(1) measured
    check_against_rows(rep, [rec])
    check_formats(rep)


def constructed(seed: int = 0):
    """Three workloads whose verdicts are known:
    - "code" on the memory-bound pair: α ≈ 0.8, T_t flat, plain and speculative requests
      → speculation pays, measured;
    - "adversarial" on the same pair: α ≈ 0.1, k = 2 early, then the policy switched off
      → switched off for low acceptance;
    - "code" on the fp32 CPU pair: α ≈ 0.8 but T_t(n) = n·T_t(1) (probe) → compute-bound."""
    rng = random.Random(seed)
    recs, t = [], T0
    for i in range(120):
        t += 30
        if i % 4 == 0:
            recs.append(record(FLAT, "code", [0] * 16, [0] * 16, t_target=lambda n: 0.1,
                               created_at=t, policy="off"))
        else:
            ks = [4] * 8
            recs.append(record(FLAT, "code", ks, [accepted_run(rng, 4, 0.8) for _ in ks],
                               t_target=lambda n: 0.1, created_at=t, bandwidth=3.6e12))
    for i in range(500):
        t += 10
        ks = [2] * 4 if i < 250 else [0] * 8
        recs.append(record(FLAT, "adversarial", ks, [accepted_run(rng, k, 0.1) for k in ks],
                           t_target=lambda n: 0.1, created_at=t))
    for _ in range(60):
        t += 60
        ks = [4] * 6
        recs.append(record(SLOW, "code", ks, [accepted_run(rng, 4, 0.8) for _ in ks],
                           t_target=lambda n: 0.1 * n, t_draft=0.03, created_at=t,
                           policy="fixed:4"))
    return recs


def test_verdicts_on_constructed_workloads(store):
    recs = constructed()
    write(store, recs)
    with store.begin() as s:
        from autospec.store.write import get_or_create_pair
        slow = get_or_create_pair(s, SLOW)
        add_probe(s, slow, {"path": "eager", "target_s_by_n": {str(n): 0.1 * n for n in range(1, 9)},
                            "draft_s": 0.03, "achieved_bytes_per_s": 2e10,
                            "peak_bytes_per_s": 4e10, "utilisation": 0.5,
                            "verdict": "verification is compute bound"})
        fast = get_or_create_pair(s, FLAT)
        add_tuned_params(s, category="code", pair_id=fast, family="costmodel",
                         params={"reprobe_every": 32}, tokens_per_s=30.0,
                         baseline_tokens_per_s=25.0, provenance={
                             "study": "code-1", "trial": 17, "trials": 50,
                             "hardware": FLAT.hardware,
                             "window": {"since": "a", "until": "b", "train_traces": 80,
                                        "holdout_traces": 20},
                             "holdout": {"tuned_tokens_per_s": 28.0,
                                         "baseline_tokens_per_s": 25.0, "traces": 20}})
    rep = build_report(store)
    check_against_rows(rep, recs)
    by = {(w.category, w.pair["dtype"]): w for w in rep.workloads}

    pays = by[("code", "bfloat16")]
    assert pays.verdict.kind == "pays", pays.verdict
    assert pays.speedup.source == "measured" and pays.speedup.k == 4
    assert pays.verdict.text == f"speculation pays here: {pays.speedup.measured:.2f}× at k = 4 " \
                                "(measured)"
    assert pays.speedup.measured > 1.5 and pays.verification.memory_bound is True
    assert pays.verification.cost_ratio == pytest.approx(1.0)
    assert pays.verification.bandwidth_utilisation == pytest.approx(0.75)
    # the cost model agrees with the measurement here (same costs, α by position)
    assert pays.speedup.estimated == pytest.approx(pays.speedup.measured, rel=0.15)
    tu = pays.policy.tuned
    assert tu.family == "costmodel" and tu.gain == pytest.approx(1.2)
    assert tu.holdout_gain == pytest.approx(1.12) and tu.holdout_traces == 20

    off = by[("adversarial", "bfloat16")]
    assert off.policy.k_in_force == 0 and off.verdict.switched_off
    assert off.verdict.kind == "low_acceptance"
    assert re.fullmatch(r"switched off: the draft matches only \d+ %", off.verdict.text)
    assert f"{off.acceptance.alpha * 100:.0f} %" in off.verdict.text

    cb = by[("code", "float32")]
    assert cb.verdict.kind == "compute_bound", cb.verdict
    assert cb.verdict.text.startswith("verification is compute-bound here: "
                                      "T_t(5) = 5.0 × T_t(1)")
    assert cb.speedup.source == "estimated" and cb.speedup.value < 1
    assert cb.speedup.flat_oracle > 1.05  # free verification would have paid
    assert cb.verification.source_by_n[1] == "probe" and cb.verification.memory_bound is False
    assert cb.verification.probe["utilisation"] == 0.5

    text, html, _ = check_formats(rep)
    assert "measured" in text and "estimated" in text and "costmodel" in text
    assert html.count("<svg") == 4 * 3


def test_batched_rows_do_not_enter_the_batch_1_verdict(store):
    """Rows of batched calls run at the batch's k and share its wall time: the latest ones
    here ran at batch 16 with k = 0 (off, as the cost model chooses there), each row at a
    sixteenth of a batch-1 request's rate. The verdict, the measured speedup and the k in
    force are batch 1's; before, they read "switched off" and a plain rate of the batch rows."""
    flat = (lambda n: 0.1)  # noqa: E731 - T_t(n), memory-bound
    spec = [record(FLAT, "code", [3] * 8, [3] * 8, t_target=flat, created_at=T0 + i)
            for i in range(6)]
    plain = [record(FLAT, "code", [0] * 4, [0] * 4, t_target=flat, created_at=T0 + 10 + i)
             for i in range(6)]
    batched = []
    for i in range(32):
        r = record(FLAT, "code", [0] * 32, [0] * 32, t_target=lambda n: 1.6,
                   created_at=T0 + 100 + i, policy="auto")
        r.batch_size = 16
        batched.append(r)
    write(store, spec + plain + batched)
    rep = build_report(store)
    check_against_rows(rep, spec + plain + batched)
    (w,) = rep.workloads
    assert w.traffic.requests == 44
    assert w.speedup.plain.requests == 6 and w.speedup.speculative.requests == 6
    # 4 tokens per (3 T_d + T_t(4)) against 1 token per T_t(1), T_d = 0.01 s
    assert w.speedup.measured == pytest.approx((4 / 0.13) / (1 / 0.1))
    assert w.policy.k_in_force == 3 and w.policy.recent_requests == 12
    assert w.verdict.kind == "pays" and not w.verdict.switched_off, w.verdict
    assert "over the latest 12 batch-1 requests" in render_text(rep)


def test_a_workload_without_a_draft_model_has_its_history(store):
    """Requests that only prompt lookup served (a pair without a draft model: no model row)
    count in the report's history buckets, their requests and tokens, with no drafted
    tokens of a model; a request whose lookup row is damaged (more accepted than proposed,
    written by hand) is left out of them, as out of every sum."""
    from dataclasses import replace

    from sqlalchemy import select, update

    from autospec.store import queries
    from autospec.store.tables import CategoryProposer, Request, RequestProposer

    bare = PairInfo("org/target-7b", "none (n-gram)", "bfloat16", "cpu: 2 threads")
    recs = []
    for i in range(6):
        ks, accs = [3, 0, 2], [2, 0, 1]
        rec = record(bare, "solo", ks, accs, t_target=lambda n: 0.1, created_at=T0 + i,
                     policy="ngram:3")
        recs.append(replace(rec, proposer_schedule=["ngram", None, "ngram"],
                            proposers=lookup("ngram", trace=bytes(rec.new_tokens),
                                             **blocks(ks, accs))))
    write(store, recs)
    with store.begin() as s:  # in its row and in its category's sums, as ingest once wrote
        damaged = s.scalar(select(Request.id).order_by(Request.id.desc()).limit(1))
        s.execute(update(RequestProposer).where(RequestProposer.request_id == damaged)
                  .values(accepted=99))
        s.execute(update(CategoryProposer).values(accepted=CategoryProposer.accepted + 96))
    (w,) = build_report(store).workloads
    assert [(h["requests"], h["new_tokens"], h["drafted"]) for h in w.history] == [
        (5, 5 * recs[0].new_tokens, 0)]
    assert w.traffic.requests == 5 and any(f"request {damaged} " in n
                                          for n in build_report(store).skipped)
    with store.session() as s:
        (sm,) = queries.category_summaries(s)
    assert sm.proposers["ngram"].proposed == 5 * 5 and "draft" not in sm.proposers


def test_cli_formats_out_dir_and_filters(store, tmp_path, capsys, monkeypatch):
    write(store, constructed())
    url = f"sqlite:///{tmp_path / 'r.db'}"
    out = tmp_path / "out"
    args = _parse(["report", "--db", url, "--format", "text", "--out", str(out)])
    assert args.run(args, args.parser) == 0  # --out DIR: every format, whatever --format says
    said = capsys.readouterr().out
    for name in ("report.txt", "report.html", "report.json"):
        assert (out / name).is_file() and str(out / name) in said
    assert (out / "report.html").read_text(encoding="utf-8").count("<svg") == 12
    js = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert len(js["workloads"]) == 3
    args = _parse(["report", "--db", url, "--format", "json", "--category", "code"])
    assert args.run(args, args.parser) == 0
    js = json.loads(capsys.readouterr().out)
    assert [w["category"] for w in js["workloads"]] == ["code", "code"]
    pid = js["workloads"][0]["pair"]["id"]
    args = _parse(["report", "--db", url, "--category", "code", "--pair-id", str(pid)])
    assert args.run(args, args.parser) == 0
    assert capsys.readouterr().out.count("\nverdict: ") == 1
    monkeypatch.chdir(tmp_path)
    args = _parse(["report", "--db", url, "--format", "html"])
    assert args.run(args, args.parser) == 0
    assert "autospec-report.html" in capsys.readouterr().out
    assert (tmp_path / "autospec-report.html").read_text(encoding="utf-8").count("<svg") == 12


def test_cli_bad_url_exits_2(capsys):
    args = _parse(["report", "--db", "nosuchdialect://x/y"])
    with pytest.raises(SystemExit) as exit_:
        args.run(args, args.parser)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("autospec: error:") and "nosuchdialect" in err


def test_report_does_not_import_torch():
    code = ("import sys, autospec.report, autospec.report.svg, autospec.store.history, autospec.cli.report, autospec.cli.stats; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_history_sql_renders_for_postgresql():
    from sqlalchemy import func, select
    from sqlalchemy.dialects import postgresql

    from autospec.store.history import _bucket_expr
    b = _bucket_expr("postgresql", 300).label("bucket")
    sql = str(select(b, func.count()).group_by(b).compile(dialect=postgresql.dialect()))
    assert "EXTRACT(epoch FROM requests.created_at) / CAST(300 AS NUMERIC)" in sql
    assert sql.count("300") == 2 and "%(" not in sql  # no bind parameter to mismatch


def test_100k_requests(tmp_path, record_property):
    """A large synthetic store: numbers still equal the rows; time and memory printed."""
    rng = random.Random(5)
    pairs = [FLAT, SLOW]
    cats = ["code", "chat", "translation"]
    templates = []  # a few hundred request shapes, reused: building 100k records stays fast
    for i in range(300):
        if i % 5 == 0:
            ks = [0] * rng.randint(4, 16)
        else:
            ks = [rng.choice((1, 2, 3, 4, 6))] * rng.randint(2, 10)
        templates.append((ks, [accepted_run(rng, k, 0.7) for k in ks]))
    recs = []
    t = T0
    for i in range(100_000):
        t += rng.uniform(0.5, 4.0)  # ~2.6 days of traffic
        ks, accs = templates[rng.randrange(len(templates))]
        recs.append(record(pairs[i % 2], cats[i % 3], ks, accs,
                           t_target=lambda n: 0.05 + 0.004 * n, created_at=t,
                           policy=rng.choice(("costmodel", "bandit"))))
    path = tmp_path / "big.db"
    store = open_store(f"sqlite:///{path}")
    t_write = time.perf_counter()
    write(store, recs, batch=10_000)
    t_write = time.perf_counter() - t_write
    t_build = time.perf_counter()
    rep = build_report(store)
    t_build = time.perf_counter() - t_build
    tracemalloc.start()
    build_report(store)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    t_render = time.perf_counter()
    check_formats(rep)
    t_render = time.perf_counter() - t_render
    store.close()
    msg = (f"100k-request report: build {t_build:.2f} s, peak traced memory "
           f"{peak / 2**20:.1f} MiB, render (all 3 formats + checks) {t_render:.2f} s; "
           f"store written in {t_write:.1f} s ({path.stat().st_size / 2**20:.0f} MiB)")
    print(msg)
    log.warning(msg)
    record_property("report_build_s", round(t_build, 3))
    record_property("report_peak_mib", round(peak / 2**20, 2))
    assert len(rep.workloads) == 6 and sum(w.traffic.requests for w in rep.workloads) == 100_000
    assert all(w.history and len(w.history) <= 48 for w in rep.workloads)
    check_against_rows(rep, recs)
    assert all(w.speedup.source == "measured" for w in rep.workloads)
    assert MIN_DRAFTED < min(w.acceptance.drafted for w in rep.workloads)


def test_cost_inputs_take_one_source():
    """A quiet probe's curve is never mixed with a busy server's means (that invented a
    2× step at n = 2 on the real pair); without a probe only well-measured live points count."""
    from types import SimpleNamespace

    from autospec.report import MIN_FORWARDS, cost_inputs

    sm = SimpleNamespace(t_target_s_by_n={1: 0.5, 2: 1.0, 6: 0.36},
                         target_count_by_n={1: MIN_FORWARDS, 2: 3, 6: 200},
                         t_draft_s=0.3, draft_forwards=500)
    probe = {"target_s_by_n": {"1": 0.2, "2": 0.22, "6": 0.24}, "draft_s": 0.1}
    curve, src, t_draft = cost_inputs(sm, probe)
    assert curve == {1: 0.2, 2: 0.22, 6: 0.24} and set(src.values()) == {"probe"}
    assert t_draft == 0.1
    curve, src, t_draft = cost_inputs(sm, None)
    assert curve == {1: 0.5, 6: 0.36} and set(src.values()) == {"requests"}  # n = 2: 3 forwards
    assert t_draft == 0.3


# ---- read as an operator would (issue 12) ------------------------------------------------

HF_TARGET = "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF/qwen2.5-coder-7b-instruct-q8_0.gguf"
HF_DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF/qwen2.5-coder-1.5b-instruct-q8_0.gguf"
HF = PairInfo(HF_TARGET, HF_DRAFT, "bfloat16", "cuda: NVIDIA H200 (143 GB, driver 560.35.03)",
              8_000_000_000, 1_600_000_000)
LONG_CATEGORIES = ("python-code-completion-with-long-context-from-the-ide-plugin",
                   "customer-support-chat/" + "very-long-tenant-name-" * 5, "translation")


def wilson(a: int, n: int) -> tuple[float, float]:
    """The Wilson score interval, written out here (z for 95 %)."""
    z = 1.959963984540054
    p = a / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _svg(html: str, title: str) -> ET.Element:
    for svg in re.findall(r"<svg\b.*?</svg>", html, re.S):
        root = ET.fromstring(svg)
        if root.findtext("title", "").startswith(title):
            return root
    raise AssertionError(f"no plot {title!r}")


def test_text_fits_a_terminal_and_names_the_pair_once(store):
    """Long Hugging Face names and long categories: before, every summary row repeated the
    pair's names and the summary ran ~280 characters wide."""
    rng = random.Random(3)
    recs = [record(HF, LONG_CATEGORIES[i % 3], [3] * 6, [accepted_run(rng, 3, 0.7)
                                                         for _ in range(6)],
                   t_target=lambda n: 0.02 * (1 + 0.05 * n), created_at=T0 + 60 * i,
                   policy="costmodel:reprobe_every=32,explore=0.05")
            for i in range(60)]
    write(store, recs)
    with store.begin() as s:
        from autospec.store.write import get_or_create_pair
        pid = get_or_create_pair(s, HF)
        add_probe(s, pid, {"path": "eager",
                           "target_s_by_n": {str(n): 0.02 * (1 + 0.01 * n) for n in range(1, 17)},
                           "draft_s": 0.004, "verdict": "memory-bound up to n = 16"})
        add_tuned_params(s, category=LONG_CATEGORIES[0], pair_id=pid, family="costmodel",
                         params={"reprobe_every": 32, "explore": 0.05}, tokens_per_s=30.0,
                         baseline_tokens_per_s=25.0, provenance={"study": "s" * 40, "trial": 3})
    rep = build_report(store)
    text, _, _ = check_formats(rep)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    # the pair is named in one legend and once per workload, never per row
    assert text.count(HF_TARGET) == text.count(HF_DRAFT) == 1 + len(rep.workloads)
    summary = text.split("\npairs:", 1)[0]
    assert HF_TARGET not in summary and "qwen2.5-coder" not in summary


def test_acceptance_by_position_counts_and_intervals(store):
    """Per position: accepted / drafted counts from the store, a Wilson interval, and thin
    evidence marked; before, a position drafted twice showed a bare 1.00."""
    # iterations at k = 4, 2, 1 with known accepted lengths: per position i, drafted =
    # #(k ≥ i), accepted = #(accepted ≥ i)
    ks = [4, 4] + [2] * 10 + [1] * 30
    accs = [4, 4] + [2] * 4 + [1] * 3 + [0] * 3 + [1] * 12 + [0] * 18
    recs = [record(FLAT, "code", ks, accs, t_target=lambda n: 0.1, created_at=T0 + i)
            for i in range(3)]
    write(store, recs)
    drafted = [3 * sum(k >= i for k in ks) for i in range(1, 5)]
    accepted = [3 * sum(a >= i for a in accs) for i in range(1, 5)]
    assert drafted == [126, 36, 6, 6] and accepted == [63, 18, 6, 6]
    (w,) = build_report(store).workloads
    a = w.acceptance
    assert a.drafted_by_position == drafted and a.accepted_by_position == accepted
    for got, want in zip(a.by_position_ci95, [wilson(x, n) for x, n in zip(accepted, drafted)]):
        assert got == pytest.approx(want, abs=1e-12)
    text, html, js = check_formats(build_report(store))
    assert js["workloads"][0]["acceptance"]["accepted_by_position"] == accepted
    rows = {int(line.split()[0]): line.split() for line in text.splitlines()
            if re.match(r"^\d+ +\d+/\d+ ", line)}
    for i, (x, n) in enumerate(zip(accepted, drafted), 1):
        lo, hi = wilson(x, n)
        assert rows[i][1] == f"{x}/{n}" and rows[i][3:5] == [f"[{lo:.2f},", f"{hi:.2f}]"]
        assert ("thin:" in rows[i]) == (n < 20)
    svg = _svg(html, "acceptance by draft position")
    notes = [t.text for t in svg.iter("text") if (t.text or "").startswith("n=")]
    assert notes == [f"n={n}" for n in drafted]
    whiskers = [p for p in svg.iter("path") if p.get("stroke") == "#222222"]
    assert len(whiskers) == 4
    bars = [r for r in svg.iter("rect") if r.find("title") is not None]
    assert [r.get("fill-opacity") == "0.3" for r in bars] == [n < 20 for n in drafted]
    assert bars[2].findtext("title") == "position 3: 6/6 accepted, 95 % " \
        f"[{wilson(6, 6)[0]:.2f}, 1.00]"


def test_cost_curve_says_where_each_point_comes_from(store):
    """The probe's medians and the requests' means are told apart (shape, legend, column);
    live points carry their forward count and an interval from their spread; before, a
    T_t(2)/T_t(1) from a handful of forwards was drawn as firmly as the probe's."""
    rng = random.Random(7)
    times = {1: [0.020 + 0.002 * rng.random() for _ in range(40)],
             2: [0.033, 0.031, 0.035, 0.030, 0.036]}  # 5 forwards at n = 2: 1.65×
    ks = [0] * 40 + [1] * 5
    it = {n: iter(ts) for n, ts in times.items()}
    rec = record(FLAT, "code", ks, [0] * 40 + [1] * 5, t_target=lambda n: next(it[n]))
    write(store, [rec])
    with store.begin() as s:
        from autospec.store.write import get_or_create_pair
        add_probe(s, get_or_create_pair(s, FLAT),
                  {"path": "eager", "target_s_by_n": {"1": 0.02, "2": 0.0204, "4": 0.021},
                   "draft_s": 0.004})
    rep = build_report(store)
    (w,) = rep.workloads
    v = w.verification
    assert v.source_by_n == {1: "probe", 2: "probe", 4: "probe"}
    assert {n: c for n, (_, c) in v.live_by_n.items()} == {1: 40, 2: 5}
    m1, m2 = (statistics.mean(times[n]) for n in (1, 2))
    s1, s2 = (statistics.stdev(times[n]) for n in (1, 2))
    r = m2 / m1
    rel = math.sqrt((s2 / m2) ** 2 / 5 + (s1 / m1) ** 2 / 40)
    t_4df = 2.776  # Student's t, 97.5 %, 4 degrees of freedom (the fewer forwards)
    assert v.live_ratio_ci95[2] == pytest.approx((r * (1 - t_4df * rel), r * (1 + t_4df * rel)))
    text, html, _ = check_formats(rep)
    row = next(line.split() for line in text.splitlines() if re.match(r"^2 +20\.4 ", line))
    lo, hi = v.live_ratio_ci95[2]
    assert row == ["2", "20.4", "1.02", f"{m2 * 1e3:.1f}", "5*", f"{r:.2f}", f"[{lo:.2f},",
                   f"{hi:.2f}]", "probe"]
    assert "* fewer than 16 forwards: shown, too few for the cost model to use" in text
    svg = _svg(html, "cost of scoring n tokens")
    legend = [t.text or "" for t in svg.iter("text")]
    assert any(t.startswith("probe (median), used") for t in legend)
    assert any(t.startswith("live mean (label: forwards; hollow: < 16)") for t in legend)
    assert len([e for e in svg.iter("rect") if e.get("width") == "7"]) == 3 + 1  # + legend
    hollow = [c for c in svg.iter("circle") if c.get("fill") == "#ffffff"]
    assert len(hollow) == 1  # n = 2: 5 forwards; n = 1 (40) drawn solid
    assert "5" in legend and "40" in legend  # the forwards behind each live point


def _outside(svg: ET.Element) -> list[tuple[str, float, float]]:
    """The texts of a plot that reach outside its width, by an estimate of their extent at
    their font size (DejaVu Sans, the usual sans-serif: digits 0.636 em)."""
    width = float(svg.get("width"))
    out = []
    for t in svg.iter("text"):
        if t.get("transform"):
            continue  # the rotated y label
        w = 0.64 * float(t.get("font-size", 11)) * len(t.text or "")
        x = float(t.get("x"))
        lo, hi = {"start": (x, x + w), "end": (x - w, x), "middle": (x - w / 2, x + w / 2)
                  }[t.get("text-anchor", "start")]
        if lo < 0 or hi > width:
            out.append((t.text, lo, hi))
    return out


def test_time_axis_labels_stay_inside_the_plot(store):
    """"acceptance over time" drew its last tick label centred on the plot's right edge,
    half of it outside the picture."""
    recs = [record(FLAT, "code", [2] * 4, [1] * 4, t_target=lambda n: 0.1,
                   created_at=T0 + 3600 * i) for i in range(30)]
    write(store, recs)
    html = render_html(build_report(store))
    svg = _svg(html, "acceptance α over time")
    ticks = [t for t in svg.iter("text") if re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d",
                                                         t.text or "")]
    assert len(ticks) == 2
    assert _outside(svg) == []


def test_no_label_leaves_its_plot(store):
    """Every text of every plot of a report with measured and estimated speedups, probes,
    live points and a batch grid lies inside its picture (the speedup plot's legend, with
    the requests behind the measured speedup, ran past its right edge once)."""
    from test_report_batch import fill

    fill(store)
    write(store, [r for r in constructed() if r.category == "adversarial"])
    html = render_html(build_report(store))
    svgs = [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", html, re.S)]
    assert len(svgs) >= 10
    for svg in svgs:
        assert _outside(svg) == [], svg.findtext("title")


def test_too_few_live_timings_say_how_many(store):
    """No probe, and fewer forwards of T_t(1) than the cost model needs: the report says how
    many it has and how many it needs, not only "run autospec probe"."""
    from autospec.report import MIN_FORWARDS

    ks = [0] * 5 + [3] * 40  # 5 forwards at n = 1, 40 at n = 4
    recs = [record(FLAT, "code", ks, [0] * 5 + [2] * 40, t_target=lambda n: 0.1,
                   created_at=T0)]
    write(store, recs)
    rep = build_report(store)
    (w,) = rep.workloads
    want = (f"5 forwards of T_t(1) measured, {MIN_FORWARDS} needed "
            "(run `autospec probe`, or serve more traffic)")
    assert w.verification.cost_note == want
    assert w.verdict.kind == "unknown" and w.verdict.text.endswith(want)
    text, html, _ = check_formats(rep)
    assert want in " ".join(text.split())
    assert want.replace("`", "&#x60;") in html or want in html
    # the empty speedup plot says it too, inside its picture (no plain requests here)
    svg = _svg(html, "speedup vs k")
    said = " ".join(t.text or "" for t in svg.iter("text") if t.get("fill") == "#777777")
    assert said == want and _outside(svg) == []


def test_stored_strings_reach_the_terminal_escaped(store, tmp_path, capsys):
    """A category, model names, hardware, a policy and a probe's verdict carrying ESC, BEL,
    C1 and bidi controls: the text report shows them as escapes, never raw."""
    evil = PairInfo("org/t\x1b[2J", "org/d\u202e", "bf16\x9b31m", "cuda\x07")
    recs = [record(evil, "chat\x1b]0;pwned\x07\n", [2] * 4, [1] * 4, t_target=lambda n: 0.1,
                   created_at=T0 + i, policy="fixed\x1b[31m") for i in range(3)]
    write(store, recs)
    with store.begin() as s:
        from autospec.store.write import get_or_create_pair
        add_probe(s, get_or_create_pair(s, evil),
                  {"path": "eager", "target_s_by_n": {"1": 0.1, "2": 0.1}, "draft_s": 0.01,
                   "verdict": "ok\x1b[8m\u2066"})
    assert main(["report", "--db", f"sqlite:///{tmp_path / 'r.db'}"]) == 0
    out = capsys.readouterr().out
    bad = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
    assert not bad.search(out), bad.search(out)
    for shown in ("chat\\x1b]0;pwned\\x07\\n", "org/t\\x1b[2J", "org/d\\u202e",
                  "bf16\\x9b31m", "cuda\\x07", "fixed\\x1b[31m", "ok\\x1b[8m\\u2066"):
        assert shown in out, shown
    # JSON to a terminal too: escaped as JSON escapes, decoding to the stored strings
    assert main(["report", "--db", f"sqlite:///{tmp_path / 'r.db'}", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", out)
    (w,) = json.loads(out)["workloads"]
    assert w["category"] == "chat\x1b]0;pwned\x07\n" and w["pair"]["draft"] == "org/d\u202e"
    assert w["pair"]["dtype"] == "bf16\x9b31m"
    # HTML: names shown escaped too (a bidi override would reorder the page's text)
    html = render_html(build_report(store))
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", html)
