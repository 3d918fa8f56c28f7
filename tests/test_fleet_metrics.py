"""`autospec metrics --db URL --port P`: the store's aggregates scraped over HTTP from the real
command (a subprocess), equal to the store's rows and to the live exporter's counters for the
same requests; the Grafana dashboard is valid JSON and queries only exposed metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_metrics import pick, scrape
from test_ngram import _repetitive
from test_report_batch import BATCHES, expected_view, fill

import autospec
from autospec.fleet.metrics import Metrics, serve_store, start_http_server
from autospec.store import open_store, queries

from conftest import noisy_copy, prompt, tiny
from test_store import BACKENDS, fresh_url

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "autospec.json"


def serve_cli(url: str):
    """Start `autospec metrics` on a free port; (process, metrics URL)."""
    proc = subprocess.Popen([sys.executable, "-m", "autospec.cli", "metrics", "--db", url,
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    m = re.search(r"(http://\S+/metrics)", line)
    if m is None:
        proc.kill()
        raise AssertionError(f"no URL in {line!r}: {proc.stderr.read()}")
    return proc, m.group(1)


def scrape_cli(url: str) -> dict:
    """One scrape of `autospec metrics` serving the store at ``url`` (started and stopped)."""
    proc, endpoint = serve_cli(url)
    try:
        return scrape(endpoint)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def run_store(tmp_path_factory):
    """A store and a live scrape of the same tiny-model requests (with a fallback)."""
    tmp = tmp_path_factory.mktemp("fleet")
    url = f"sqlite:///{tmp / 'f.db'}"
    target = tiny("qwen2", sharpen=30.0)
    metrics = Metrics()
    spec = autospec.Controller(target, noisy_copy(target, 0.15), store=url, metrics=metrics,
                               names=("org/t", "org/d"))
    for seed, (cat, k) in enumerate([("code", 3), ("code", 1), ("chat", 0), ("chat", 2)]):
        spec.generate(prompt(10, seed=seed), max_new_tokens=16, do_sample=False, k=k,
                      category=cat, eos_token_id=None)
    spec.generate(torch.cat([prompt(8, seed=5), prompt(8, seed=6)]), max_new_tokens=8,
                  do_sample=False, k=2, category="chat", eos_token_id=None,
                  attention_mask=torch.ones(2, 8, dtype=torch.long))
    spec.generate(prompt(6), max_new_tokens=4, num_beams=2)
    spec.close()
    # prompt lookup on a repetitive prompt: n-gram blocks beside the draft model's
    hybrid = autospec.Controller(target, noisy_copy(target, 0.15), store=url, metrics=metrics,
                                 names=("org/t", "org/d"), policy="hybrid:3:1")
    hybrid.generate(_repetitive(4), max_new_tokens=24, do_sample=False, category="rep",
                    eos_token_id=None)
    loop = hybrid.last_stats
    hybrid.close()
    assert loop.proposer("ngram").blocks > 0 and loop.drafts > 0
    # and without a draft model at all: prompt lookup only
    solo = autospec.Controller(target, None, store=url, metrics=metrics, policy="ngram:4")
    solo.generate(_repetitive(5), max_new_tokens=16, do_sample=False, category="solo",
                  eos_token_id=None)
    assert solo.last_stats.proposer("ngram").blocks > 0 and solo.last_stats.drafts == 0
    solo.close()
    live = start_http_server(0, metrics=metrics)
    try:
        samples = scrape(live.url)
    finally:
        live.close()
    return url, samples, loop


def test_the_command_serves_the_store_and_matches_the_live_counters(run_store):
    url, live, loop = run_store
    fleet = scrape_cli(url)
    with open_store(url, read_only=True) as st, st.session() as s:
        sums = {sm.category: sm for sm in queries.category_summaries(s)}
    assert pick(fleet, "autospec:store_up") == 1
    for cat, sm in sums.items():
        if cat == "solo":  # another pair (no draft model): below
            continue
        lab = dict(category=cat, pair="t/d", proposer="draft", model_name="t")
        for name, value in [("vllm:spec_decode_num_drafts_total", sm.drafts),
                            ("vllm:spec_decode_num_draft_tokens_total", sm.drafted),
                            ("vllm:spec_decode_num_accepted_tokens_total", sm.accepted),
                            ("autospec:requests_total", sm.requests),
                            ("autospec:iterations_total", sm.iterations),
                            ("autospec:generation_tokens_total", sm.new_tokens)]:
            assert pick(fleet, name, **lab) == value == pick(live, name, **lab), name
        for pos, a in enumerate(sm.accepted_per_position):
            assert pick(fleet, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        position=pos, **lab) == a
        assert pick(fleet, "autospec:speculation_off_share", **lab) == pytest.approx(
            pick(live, "autospec:speculation_off_share", **lab))
        hw = {dict(lv).get("hardware") for n, lv in fleet if n.startswith("vllm:")}
        assert hw == {sm.pair.hardware}
    # the n-gram proposer's blocks: its own series, equal to the store's, the live scrape's
    # and the loop's own counts
    sm, mine = sums["rep"].proposers["ngram"], loop.proposer("ngram")
    assert (sm.blocks, sm.proposed, sm.accepted) == (mine.blocks, mine.proposed, mine.accepted)
    ng = dict(category="rep", pair="t/d", proposer="ngram", model_name="t")
    for name, value in [("vllm:spec_decode_num_drafts_total", mine.blocks),
                        ("vllm:spec_decode_num_draft_tokens_total", mine.proposed),
                        ("vllm:spec_decode_num_accepted_tokens_total", mine.accepted)]:
        assert pick(fleet, name, **ng) == value == pick(live, name, **ng), name
    for name, counts in [("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                          mine.accepted_per_position),
                         ("autospec:spec_decode_num_draft_tokens_per_pos_total",
                          mine.proposed_per_position)]:
        for pos, c in enumerate(counts):
            assert pick(fleet, name, position=pos, **ng) == c == pick(live, name, position=pos,
                                                                      **ng), (name, pos)
    solo = sums["solo"].proposers["ngram"]
    assert "draft" not in sums["solo"].proposers  # no draft model: no model row
    for name, value in [("vllm:spec_decode_num_drafts_total", solo.blocks),
                        ("vllm:spec_decode_num_draft_tokens_total", solo.proposed),
                        ("vllm:spec_decode_num_accepted_tokens_total", solo.accepted)]:
        assert value > 0 or name.endswith("accepted_tokens_total")
        assert pick(fleet, name, category="solo", proposer="ngram") == value == pick(
            live, name, category="solo", proposer="ngram"), name
    # the same series from either source: a dashboard summing by proposer sees no difference
    def series(samples):
        return {(n, lv) for n, lv in samples if n.endswith("_total")
                and n.startswith(("vllm:spec_decode", "autospec:spec_decode"))}
    strip = {(n, tuple(kv for kv in lv if kv[0] != "hardware")) for n, lv in series(fleet)}
    assert strip == series(live)
    assert {dict(lv)["proposer"] for _, lv in strip} == {"draft", "ngram"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_speedup_and_k_by_batch_size_follow_the_report(backend, tmp_path):
    url, cleanup = fresh_url(backend, tmp_path)  # PostgreSQL where CI provides one
    try:
        st = open_store(url)
        recs = fill(st, tuned=False)
        st.close()
        ks, _, _ = expected_view(recs)
        with open_store(url, read_only=True) as st:
            exp = serve_store(st, 0)
            try:
                fleet = scrape(exp.url)
            finally:
                exp.close()
    finally:
        cleanup()
    for b in BATCHES:
        assert pick(fleet, "autospec:k_by_batch", category="code", batch=b) == ks[b][0]
        assert pick(fleet, "autospec:speedup_estimate_by_batch", category="code",
                    batch=b) == pytest.approx(ks[b][1], rel=1e-6)
    assert pick(fleet, "autospec:k_in_force", category="code") == 4
    assert pick(fleet, "autospec:speedup_estimate", category="code") > 1


def test_a_store_that_fails_to_read_scrapes_as_down(tmp_path):
    url = f"sqlite:///{tmp_path / 'gone.db'}"
    open_store(url).close()
    st = open_store(url, read_only=True)
    exp = serve_store(st, 0)
    try:
        (tmp_path / "gone.db").unlink()
        (tmp_path / "gone.db").write_bytes(b"not a database" * 100)
        st.engine.dispose()  # pooled connections still hold the old file open
        assert pick(scrape(exp.url), "autospec:store_up") == 0
    finally:
        exp.close()
        st.close()


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "must be in 0..65535"),
    (["--port", "x"], "expected an integer"),
    (["--db", "/nonexistent/dir/none.db"], ""),
])
def test_bad_input_is_one_error_line(argv, message):
    r = subprocess.run([sys.executable, "-m", "autospec.cli", "metrics", *argv],
                       capture_output=True, text=True, timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("autospec: error:")
    assert message in err[0]


def test_port_in_use_is_one_error_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'p.db'}"
    open_store(url).close()
    proc, endpoint = serve_cli(url)
    try:
        port = endpoint.rsplit(":", 1)[1].split("/")[0]
        r = subprocess.run([sys.executable, "-m", "autospec.cli", "metrics", "--db", url,
                            "--port", port], capture_output=True, text=True, timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "cannot serve" in err[0]


def test_the_dashboard_is_grafana_json_over_exposed_metrics(run_store, tmp_path):
    url, live, loop = run_store
    synthetic = f"sqlite:///{tmp_path / 'g.db'}"  # with a cost grid: the speedup metrics
    st = open_store(synthetic)
    fill(st)
    st.close()
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titles = " ".join(p["title"].lower() for p in panels)
    for needed in ("acceptance by draft position", "k in force", "speedup estimate",
                   "bandwidth"):
        assert needed in titles
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    assert all(p["gridPos"]["w"] > 0 and p["targets"] for p in panels)
    # every metric queried is one an exporter exposes, seen in a real scrape of each
    exposed = {n for n, _ in live}
    for db in (url, synthetic):
        with open_store(db, read_only=True) as st:
            exp = serve_store(st, 0)
            try:
                exposed |= {n for n, _ in scrape(exp.url)}
            finally:
                exp.close()
    queried = {m for e in exprs for m in re.findall(r"(?:vllm|autospec):[a-zA-Z0-9_]+", e)}
    assert queried and queried <= exposed, queried - exposed
    # and the braces and parentheses of every query balance
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
