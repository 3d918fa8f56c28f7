"""``autospec report`` per proposer: acceptance by position for the draft model and the n-gram
proposer, and which one pays per workload, from a real SQLite store whose greedy traffic
copies its input in one category and not in the other. The estimates are recomputed here
from their definition."""

from __future__ import annotations

import random

import pytest
from test_tune_ngram import CURVE, _record, copy_and_free_store

from autospec.costs.price import expected_tokens, interpolate_cost
from autospec.report import build_report, render_html, render_text
from autospec.store import open_store


@pytest.fixture
def store(tmp_path):
    st = copy_and_free_store(tmp_path / "r.db", 30, seed=1)
    yield st
    st.close()


def test_the_proposer_that_pays_per_workload(store):
    report = build_report(store)
    by_cat = {w.category: w.proposers for w in report.workloads}
    copy, free = by_cat["copy"], by_cat["free"]
    ngram = copy.lookups["ngram"]
    # copy: a match at ~90 % of positions, agreeing on 8 tokens each time
    assert ngram.match_rate == pytest.approx(0.9, abs=0.05)
    assert ngram.conditional[:8] == [1.0] * 8
    assert copy.pays in ("ngram", "hybrid") and copy.margin > 1.0
    # the n-gram's estimate, from its definition
    cost = interpolate_cost(CURVE)
    r, t1 = ngram.match_rate, cost(1)
    k = ngram.best[0]
    e = expected_tokens(ngram.conditional, k)
    assert ngram.best[1] == pytest.approx((r * e + 1 - r) * t1 / (r * cost(k + 1) + (1 - r) * t1))
    assert ngram.best[1] > copy.draft[1]
    # free: no match anywhere, so no estimate for the n-gram (not plain decoding's 1.0 under
    # its name), and the draft model pays
    assert free.lookups["ngram"].match_rate == 0.0 and free.lookups["ngram"].best is None
    assert free.pays == "draft" and free.hybrid is None
    text = render_text(report)
    assert "5. proposers: prompt lookup pays" in text or "5. proposers: the hybrid" in text
    assert "5. proposers: the draft model pays" in text
    assert "prompt lookup where it had a draft (traces)" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    html = render_html(report)
    assert "<h3>Proposers</h3>" in html and "estimated speedup" in html


def test_traffic_served_by_prompt_lookup_is_speculative_and_headlined(tmp_path):
    """Requests that drafted only by prompt lookup (the draft model's ``drafted`` is 0) are
    speculative, not plain: the measured speedup sets them against the plain requests. The
    n-gram estimate reads its live blocks' acceptance where there are enough (its traces
    count every position and run high), and the headline says prompt lookup pays, with the
    draft model's own verdict after it."""
    from dataclasses import replace

    from autospec.store import history

    rng = random.Random(3)
    st = copy_and_free_store(tmp_path / "served.db", 0, seed=3)
    n, live = 96, (0.5, 0.8, 0.9, 0.9)  # live blocks of 4: conditional acceptance by position
    reached = [48.0]
    for a in live[:-1]:
        reached.append(reached[-1] * a)
    accepted = [r * a for r, a in zip(reached, live)]
    served = []
    for i in range(6):
        rec = _record(rng, "copy", 0.4, 0.9, 1.0e9 + i)
        blocks = replace(rec.proposers["ngram"], blocks=48, proposed=192,
                         accepted=round(sum(accepted)),
                         accepted_per_position=[round(a) for a in accepted],
                         proposed_per_position=[48] * 4, seconds=0.0)
        served.append(replace(rec, policy="ngram:4", wall_s=n * CURVE[1] / 2.5,
                              proposers={**rec.proposers, "ngram": blocks}))
    plain = [_record(rng, "copy", 0.4, 0.9, 1.0e9 + 10 + i) for i in range(4)]
    st.write(served + plain)
    try:
        with st.session() as s:
            (rates,) = history.plain_vs_speculative(s).values()
        assert (rates.plain.requests, rates.speculative.requests) == (4, 6)
        (w,) = build_report(st).workloads
        assert w.speedup.measured == pytest.approx(2.5)
        pr = w.proposers
        ngram = pr.lookups["ngram"]
        assert ngram.source == "live blocks" and ngram.live_proposed == 6 * 192
        cost = interpolate_cost(CURVE)
        r, t1, k = ngram.match_rate, cost(1), ngram.best[0]
        e = expected_tokens(ngram.live_by_position, k)
        assert ngram.best[1] == pytest.approx((r * e + 1 - r) * t1 / (r * cost(k + 1)
                                                                     + (1 - r) * t1))
        assert ngram.best[1] < 0.8 * (r * 9 + 1 - r) * t1 / (r * cost(9) + (1 - r) * t1)
        assert w.verdict.kind == "pays" and "prompt lookup" in w.verdict.text
        assert "the draft model alone: plain decoding only so far" in w.verdict.text
        text = render_text(build_report(st))
        assert "acceptance from its live blocks" in text
        # the summary's speedup is the one the verdict rests on, not the draft model's
        # … named as the registry names the proposer
        assert w.verdict.figure == (pytest.approx(ngram.best[1]), "ngram")
        assert f"{ngram.best[1]:.2f}× ngram est." in text
        assert f"{ngram.best[1]:.2f}× (ngram, estimated)" in render_html(build_report(st))
    finally:
        st.close()


def test_workloads_without_any_ngram_record_have_no_section(tmp_path):
    from dataclasses import replace

    rng = random.Random(2)
    st = open_store(f"sqlite:///{tmp_path / 'old.db'}")
    recs = [_record(rng, "old", 0.7, 0.5, 1.0e9 + i) for i in range(5)]
    st.write([replace(r, proposers={"draft": r.proposers["draft"]}) for r in recs])
    try:
        (w,) = build_report(st).workloads
        assert w.proposers is None and "5. proposers" not in render_text(build_report(st))
    finally:
        st.close()
