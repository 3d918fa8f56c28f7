"""`autospec metrics --backfill FILE`: a real store's history as timestamped OpenMetrics —
the replay ends on what the live `autospec metrics` scrape of the same store serves, each
series' timestamps increase, every step counts the requests stored by then, and promtool
(where installed) turns the file into TSDB blocks holding every sample, from which a real
Prometheus serves every panel of the dashboard (scripts/render_dashboard.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from datetime import timezone
from html import escape
from pathlib import Path

import pytest
import torch
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from sqlalchemy import select
from test_fleet_metrics import scrape_cli

import autospec
from autospec.store import open_store
from autospec.store.tables import Request

from conftest import noisy_copy, prompt, tiny

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "autospec.json"


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    """A store written by real generation with tiny random-weight models: two categories,
    k = 0 (speculation off), a batch of two."""
    tmp = tmp_path_factory.mktemp("backfill")
    url = f"sqlite:///{tmp / 'b.db'}"
    target = tiny("qwen2", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.15), store=url,
                               names=("org/t", "org/d"))
    for seed, (cat, k) in enumerate([("code", 3), ("chat", 0), ("code", 1), ("chat", 2),
                                     ("code", 4)]):
        spec.generate(prompt(10, seed=seed), max_new_tokens=16, do_sample=False, k=k,
                      category=cat, eos_token_id=None)
    spec.generate(torch.cat([prompt(8, seed=5), prompt(8, seed=6)]), max_new_tokens=8,
                  do_sample=False, k=2, category="chat", eos_token_id=None,
                  attention_mask=torch.ones(2, 8, dtype=torch.long))
    spec.close()
    return url


def created(url) -> list[tuple[float, str]]:
    with open_store(url, read_only=True) as st, st.session() as s:
        rows = s.execute(select(Request.created_at, Request.category)
                         .order_by(Request.created_at))
        return [(t.replace(tzinfo=t.tzinfo or timezone.utc).timestamp(), c) for t, c in rows]


def run_backfill(url, path, step):
    r = subprocess.run([sys.executable, "-m", "autospec.cli", "metrics", "--db", url,
                        "--backfill", str(path), "--step", repr(step)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return path.read_text(encoding="utf-8")


def series(text):
    """(name, sorted labels) → [(timestamp, value)] in file order."""
    out: dict[tuple, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert s.timestamp is not None, s
            out.setdefault((s.name, tuple(sorted(s.labels.items()))), []).append(
                (float(s.timestamp), s.value))
    return out


@pytest.fixture(scope="module")
def backfilled(store_url, tmp_path_factory):
    times = created(store_url)
    step = (times[-1][0] - times[0][0]) / 7  # several steps between the requests
    path = tmp_path_factory.mktemp("om") / "history.om"
    text = run_backfill(store_url, path, step)
    return text, times, step, path


def test_the_history_ends_on_the_live_scrape(store_url, backfilled):
    text, times, _, _ = backfilled
    assert text.rstrip().endswith("# EOF")
    hist = series(text)
    live = scrape_cli(store_url)
    assert set(hist) == set(live)
    for key, points in hist.items():
        assert points[-1][1] == pytest.approx(live[key], rel=1e-9), key
        assert times[-1][0] <= points[-1][0] <= times[-1][0] + 1e-3, key  # ms, rounded up
    # k in force is replayed too (the latest requests' k, as the report takes it): a history
    k = [p for (n, _), p in hist.items() if n == "autospec:k_in_force"]
    assert k and all(len(p) >= 3 for p in k)


def test_every_step_counts_the_requests_stored_by_then(backfilled):
    text, times, step, _ = backfilled
    hist = series(text)
    steps = set()
    for (name, labels), points in hist.items():
        ts = [t for t, _ in points]
        assert ts == sorted(ts) and len(set(ts)) == len(ts), name
        if name.endswith("_total"):
            values = [v for _, v in points]
            assert values == sorted(values), (name, labels)  # counters never fall
        if name == "autospec:requests_total":
            cat = dict(labels)["category"]
            for t, v in points:
                # the step counts what was stored by then (within a tenth of a millisecond:
                # requests of one batch are microseconds apart)
                lo, hi = (sum(1 for c_t, c in times if c == cat and c_t <= t + d)
                          for d in (-1e-4, 1e-4))
                assert lo <= v <= hi, (t, v, lo, hi)
            steps |= set(ts)
    assert len(steps) >= 5  # a history, not one point
    gaps = sorted(b - a for a, b in zip(sorted(steps), sorted(steps)[1:]))
    assert gaps[-2] == pytest.approx(step, abs=1e-3)  # the steps (ms); the last is shorter


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_makes_blocks_of_every_sample(backfilled, tmp_path):
    text, _, _, path = backfilled
    r = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(path),
                        str(tmp_path / "data")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if re.match(r"^[0-9A-Z]{26}\s", line)]
    assert rows, r.stdout
    # BLOCK ULID, MIN TIME, MAX TIME, DURATION, NUM SAMPLES, ...
    samples = sum(int(row[4]) for row in rows)
    assert samples == sum(len(p) for p in series(text).values())


@pytest.mark.skipif(shutil.which("promtool") is None or shutil.which("prometheus") is None,
                    reason="Prometheus is not installed")
def test_the_dashboard_renders_from_a_prometheus_loaded_with_the_backfill(backfilled, tmp_path):
    """The whole path: backfill → promtool blocks → a real Prometheus → every panel's query
    through its HTTP API → one HTML page with a chart or a "no data" per panel."""
    import socket
    import time
    import urllib.request

    text, times, _, path = backfilled
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(path),
                    str(tmp_path / "data")], check=True, capture_output=True, timeout=300)
    (tmp_path / "prom.yml").write_text("global:\n  scrape_interval: 1m\nscrape_configs: []\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prom = subprocess.Popen(["prometheus", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--config.file={tmp_path / 'prom.yml'}",
                             f"--web.listen-address=127.0.0.1:{port}",
                             "--storage.tsdb.retention.time=100y"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "render_dashboard.py"),
                            "--prometheus", base, "--dashboard", str(DASHBOARD),
                            "--out", str(tmp_path / "out"), "--start", repr(times[0][0] - 60),
                            "--end", repr(times[-1][0] + 60)],
                           capture_output=True, text=True, timeout=300)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
    assert r.returncode == 0, r.stderr
    counts = {m.group(2): int(m.group(1)) for m in re.finditer(
        r"^\s*(\d+) series\s+\S+\s+(.*?)(?:\s+<- no data)?$", r.stdout, re.M)}
    # this store has no batch cost grid and no fallbacks; everything else has data (the
    # batch-1 speedup estimate too: the pair's costs pool every category's forwards)
    for title, n in counts.items():
        expect_none = title.startswith(("Speedup estimate by batch size", "Fallbacks"))
        assert (n == 0) == expect_none, (title, n)
    html = (tmp_path / "out" / "dashboard.html").read_text(encoding="utf-8")
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert len(counts) == len(dash["panels"])
    for p in dash["panels"]:
        assert escape(p["title"]) in html
    assert html.count("<svg") >= sum(p["type"] == "timeseries" for p in dash["panels"])
    # two categories of the test store, per proposer, in the acceptance legend
    assert "code (draft) pos 0" in html and "chat (draft) pos 0" in html
