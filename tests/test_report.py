"""`autospec report` on real SQLite stores: its numbers recomputed from the request rows, its
verdicts on constructed workloads, its formats (text, one self-contained HTML file, JSON),
and a 100k-request store (build time and peak memory printed, never asserted)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import subprocess
import sys
import time
import tracemalloc
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

import pytest

from autospec.report import (
    MIN_DRAFTED,
    add_parser,
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
    width = max(ks) if ks else 0
    by_n: dict[int, list[float]] = defaultdict(list)
    for k in ks:
        by_n[k + 1].append(t_target(k + 1))
    drafted = sum(ks)
    wall = drafted * t_draft + sum(sum(v) for v in by_n.values())
    return RequestRecord(
        pair=pair, category=category, policy=policy, greedy=True, prompt_tokens=10,
        new_tokens=sum(accs) + len(ks), iterations=len(ks), drafts=sum(k > 0 for k in ks),
        drafted=drafted, accepted=sum(accs),
        accepted_per_position=[sum(a > i for a in accs) for i in range(width)],
        drafted_per_position=[sum(k > i for k in ks) for i in range(width)],
        k_schedule=bytes(ks), accepted_schedule=bytes(accs), wall_s=wall, prefill_s=0.0,
        draft_s=drafted * t_draft, draft_forwards=drafted, target_s_by_n=dict(by_n),
        trace_kind="greedy", trace=bytes(1 for _ in range(sum(accs) + len(ks))),
        bandwidth_bytes_per_s=bandwidth, bandwidth_peak_bytes_per_s=4.8e12 if bandwidth
        else None, created_at=created_at, path="eager")


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
    parser = argparse.ArgumentParser(prog="autospec")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


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
        e["drafted"] += r.drafted
        e["accepted"] += r.accepted
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
            cell[1] += r.drafted
            cell[2] += r.accepted
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
    # JSON: the same numbers as the dataclasses, and as the text shows them
    assert len(js["workloads"]) == len(rep.workloads)
    for w, j in zip(rep.workloads, js["workloads"]):
        assert j["traffic"]["requests"] == w.traffic.requests
        assert j["acceptance"]["alpha"] == w.acceptance.alpha
        assert j["speedup"]["value"] == w.speedup.value
        assert j["verdict"]["text"] == w.verdict.text
        assert {int(k): v for k, v in j["policy"]["k_counts"].items()} == w.policy.k_counts
        assert j["verdict"]["text"] in text and w.verdict.text in html.replace("&#x27;", "'")
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
    assert _parse(["report", "--db", url]).run(_parse(["report", "--db", url])) == 0
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
        from autospec.store.rows import get_or_create_pair
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


def test_cli_formats_out_dir_and_filters(store, tmp_path, capsys, monkeypatch):
    write(store, constructed())
    url = f"sqlite:///{tmp_path / 'r.db'}"
    out = tmp_path / "out"
    for fmt_, name in (("text", "report.txt"), ("html", "report.html"),
                       ("json", "report.json")):
        args = _parse(["report", "--db", url, "--format", fmt_, "--out", str(out)])
        assert args.run(args) == 0
        assert (out / name).is_file() and str(out / name) in capsys.readouterr().out
    js = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert len(js["workloads"]) == 3
    args = _parse(["report", "--db", url, "--format", "json", "--category", "code"])
    assert args.run(args) == 0
    js = json.loads(capsys.readouterr().out)
    assert [w["category"] for w in js["workloads"]] == ["code", "code"]
    pid = js["workloads"][0]["pair"]["id"]
    args = _parse(["report", "--db", url, "--category", "code", "--pair-id", str(pid)])
    assert args.run(args) == 0
    assert capsys.readouterr().out.count("\nverdict: ") == 1
    monkeypatch.chdir(tmp_path)
    args = _parse(["report", "--db", url, "--format", "html"])
    assert args.run(args) == 0
    assert "autospec-report.html" in capsys.readouterr().out
    assert (tmp_path / "autospec-report.html").read_text(encoding="utf-8").count("<svg") == 12


def test_cli_bad_url_exits_2(capsys):
    args = _parse(["report", "--db", "nosuchdialect://x/y"])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("autospec: error:") and "nosuchdialect" in err


def test_report_does_not_import_torch():
    code = ("import sys, autospec.report, autospec.svgplot, autospec.store.history; "
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
