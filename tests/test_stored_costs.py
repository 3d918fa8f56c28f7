"""One function builds a pair's costs from the store (``autospec.costs.stored.stored_costs``):
the controller's warm start, ``autospec tune``, ``autospec report``, ``autospec stats`` and
``autospec export`` read the same numbers from a real SQLite store, and the rule "the probe,
else live points with ≥ MIN_FORWARDS forwards" is applied in one place, which every reader
follows."""

from __future__ import annotations

import json

import pytest
from test_costgrid import _batched_row, _probe_payload
from test_costs_path import record

import autospec
import autospec.costs
from autospec.cli import main
from autospec.costs import MIN_FORWARDS
from autospec.costs.stored import StoredCosts, stored_costs
from autospec.fleet.export import plan_for
from autospec.report import build_report
from autospec.store import add_probe, open_store, queries
from autospec.telemetry import RequestTelemetry
from autospec.tune.study import tune

from conftest import noisy_copy, tiny

CURVE = {1: 0.010, 2: 0.011}  # T_t(n) of the batch-1 traffic, seconds
SLOW = {4: 0.013}  # a block length logged with fewer forwards


@pytest.fixture(scope="module")
def models():
    target = tiny("llama", layers=1)
    return target, noisy_copy(target, 0.1)


def _store(url: str, pair, *, probe: bool, batched: int) -> None:
    """Batch-1 traffic on the eager path: n = 1, 2 with exactly MIN_FORWARDS forwards, n = 4
    with 10; two batched rows at B = 4 with ``batched`` forwards each per point; with
    ``probe``, a probe of the eager path with a batch grid and the draft's catch-up."""
    per = MIN_FORWARDS // 4
    recs = ([record("eager", CURVE, 0.002, forwards=per, category="default", pair=pair)
             for _ in range(4)]
            + [record("eager", SLOW, 0.002, forwards=5, category="default", pair=pair)
               for _ in range(2)]
            + [_batched_row(pair, i, batch=4, forwards=batched, category="default")
               for i in range(2)])
    with open_store(url) as store:
        store.write(recs)
        if probe:
            with store.begin() as s:
                add_probe(s, pair, {**_probe_payload(),
                                    "draft_catch_up": [[8, 0.01], [32, 0.02]]})


def _read(url: str) -> StoredCosts:
    with open_store(url) as store, store.session() as s:
        pid = queries.pair_id(s, queries.pairs(s)[0])
        return stored_costs(s, pid, "default")


def _readers(url: str, models) -> dict:
    """What each reader ended up with: batch 1's T_t(n) and T_d, and T_t(4, 1)."""
    target, draft = models
    ctrl = autospec.Controller(target, draft, store=url, policy="auto")
    try:
        ctrl.live_stats("default")
        ctrl._warm_batched("default")  # what the first batched call warms
        one = ctrl.costs.at(ctrl.path)
        controller = (dict(one.t_target), one.t_draft,
                      ctrl.costs.target_points("eager", 4).get(1))
    finally:
        ctrl.close()
    with open_store(url) as store:
        (res,) = tune(store, category="default", trials=2, families=("fixed",), holdout=0.25,
                      seed=1, write=False, min_traces=2, min_positions=4)
        assert res.status == "tuned", res.reason
        (w,) = build_report(store, category="default").workloads
        plan = plan_for(store, category="default")
    tuned = (res.costs["t_target_s_by_n"], res.costs["t_draft_s"],
             res.costs.get("t_target_s_by_bn", {}).get(4, {}).get(1))
    points = {p.batch: p for p in w.batch.points}
    report = (w.verification.t_target_s_by_n, w.verification.t_draft_s,
              points[4].t_target_1_s if 4 in points else None)
    return {"controller": controller, "tune": tuned, "report": report,
            "tune source": res.costs["source"], "report grid source": w.batch.source,
            "export grid source": plan.grid_source,
            "export table": [(b, k) for b, k, _ in plan.table],
            "report table": [(p.batch, p.k) for p in w.batch.points if p.k is not None]}


def _stats(url: str, capsys) -> dict:
    capsys.readouterr()
    assert main(["stats", "--db", url, "--json", "--category", "default"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    return d


def test_every_reader_reads_the_one_functions_costs(models, tmp_path, capsys):
    """A store holding a probe (with a batch grid and catch-ups) and live traffic: the
    controller, tune, the report, stats and export read what ``stored_costs`` builds."""
    url = f"sqlite:///{tmp_path / 'one.db'}"
    pair = RequestTelemetry(*models, measure_peak=False).pair
    _store(url, pair, probe=True, batched=MIN_FORWARDS // 2)
    c = _read(url)
    assert c.from_probe and c.path == "eager" and c.source.startswith("probe #")
    assert c.catch_up_source == "probe" and c.grid_source.startswith("probe at the live level")
    expected = (c.t_target, c.t_draft, c.grid[4][1])
    got = _readers(url, models)
    for who in ("controller", "tune", "report"):
        assert got[who][0] == pytest.approx(expected[0]), who
        assert got[who][1] == pytest.approx(expected[1]), who
        assert got[who][2] == pytest.approx(expected[2]), who
    assert got["tune source"].startswith(c.source)
    assert "draft catch-up: the probe's (2 sizes)" in got["tune source"]
    assert f"batch > 1: {c.grid_source}" in got["tune source"]
    assert got["report grid source"] == got["export grid source"] == c.grid_source
    assert got["export table"] == got["report table"] and got["export table"]
    d = _stats(url, capsys)
    assert d["batch"]["source"] == c.grid_source
    assert d["batch"]["k_by_batch"] == {str(b): k for b, k in got["report table"]}


def test_the_live_rule_is_applied_once(models, tmp_path, capsys, monkeypatch):
    """No probe: every reader keeps the live points with ≥ MIN_FORWARDS forwards (n = 1, 2;
    not n = 4 nor the batched rows, 10 forwards each). Lower the one constant and every
    reader takes n = 4 and the batch-4 points; a probe then replaces them all."""
    url = f"sqlite:///{tmp_path / 'rule.db'}"
    pair = RequestTelemetry(*models, measure_peak=False).pair
    _store(url, pair, probe=False, batched=5)
    c = _read(url)
    assert c.t_target == pytest.approx(CURVE) and c.source == "live traffic (eager)"
    assert c.grid_source == "none" and not c.grid
    got = _readers(url, models)
    for who in ("controller", "tune", "report"):
        assert got[who][0] == pytest.approx(CURVE), who
        assert got[who][2] is None, who
    assert got["report grid source"] == "none" and "batch > 1" not in got["tune source"]
    assert _stats(url, capsys)["batch"]["source"] == "none"

    monkeypatch.setattr(autospec.costs, "MIN_FORWARDS", 8)
    low = _read(url)
    assert low.t_target == pytest.approx({**CURVE, **SLOW}) and low.grid_source == "live"
    got = _readers(url, models)
    for who in ("controller", "tune", "report"):
        assert got[who][0] == pytest.approx(low.t_target), who
        assert got[who][2] == pytest.approx(low.grid[4][1]), who
    assert got["report grid source"] == got["export grid source"] == "live"
    assert "batch > 1: live" in got["tune source"]
    assert _stats(url, capsys)["batch"]["source"] == "live"
