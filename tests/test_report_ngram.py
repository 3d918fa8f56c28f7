"""``autospec report`` per proposer: acceptance by position for the draft model and the n-gram
proposer, and which one pays per workload, from a real SQLite store whose greedy traffic
copies its input in one category and not in the other. The estimates are recomputed here
from their definition."""

from __future__ import annotations

import random

import pytest
from test_tune_ngram import CURVE, _record, copy_and_free_store

from autospec.policies.costmodel import expected_tokens, interpolate_cost
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
    # copy: a match at ~90 % of positions, agreeing on 8 tokens each time
    assert copy.match_rate == pytest.approx(0.9, abs=0.05)
    assert copy.ngram_conditional[:8] == [1.0] * 8
    assert copy.pays in ("ngram", "hybrid") and copy.margin > 1.0
    # the n-gram's estimate, from its definition
    cost = interpolate_cost(CURVE)
    r, t1 = copy.match_rate, cost(1)
    k = copy.ngram[0]
    e = expected_tokens(copy.ngram_conditional, k)
    assert copy.ngram[1] == pytest.approx((r * e + 1 - r) * t1 / (r * cost(k + 1) + (1 - r) * t1))
    assert copy.ngram[1] > copy.draft[1]
    # free: no match anywhere, the draft model pays
    assert free.match_rate == 0.0 and free.ngram is None and free.pays == "draft"
    text = render_text(report)
    assert "5. proposers: the n-gram proposer" in text or "5. proposers: the hybrid" in text
    assert "5. proposers: the draft model pays" in text
    assert "n-gram where matched (traces)" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    html = render_html(report)
    assert "<h3>Proposers</h3>" in html and "estimated speedup" in html


def test_workloads_without_any_ngram_record_have_no_section(tmp_path):
    from dataclasses import replace

    rng = random.Random(2)
    st = open_store(f"sqlite:///{tmp_path / 'old.db'}")
    st.write([replace(_record(rng, "old", 0.7, 0.5, 1.0e9 + i), ngram_trace=None, ngram=None)
              for i in range(5)])
    try:
        (w,) = build_report(st).workloads
        assert w.proposers is None and "5. proposers" not in render_text(build_report(st))
    finally:
        st.close()
