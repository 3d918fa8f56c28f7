"""Costs from one execution path: every request and probe records the path its forwards ran
on (eager, static cache, CUDA graphs), the store keeps batch-1 costs per path, and every cost
query reads one path only — per-category statistics, ``stored_costs``, ``batch_costs`` and
the controller's warm start. Old databases upgrade in place (paths unknown). SQLite always,
PostgreSQL when AUTOSPEC_TEST_POSTGRES_URL is set (as tests/test_store.py)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import MetaData, create_engine, insert, select
from test_store_batch import _create_at, _downgrade, _insert_legacy, _legacy_stats

import autospec
from autospec.costs.stored import stored_costs
from autospec.store import PairInfo, RequestRecord, add_probe, open_store, queries
from autospec.store.migrate import current_revision, head_revision
from autospec.store.tables import CategoryPath, PairCost, Request

from conftest import noisy_copy, prompt, tiny
from records import blocks, draft
from test_store import BACKENDS, fresh_url

PAIR = PairInfo("t-model", "d-model", "bfloat16", "cpu: test")
EAGER = {1: 0.010, 2: 0.011, 4: 0.013}  # T_t(n), seconds
STATIC = {1: 0.100, 2: 0.150, 4: 0.250}  # very different: another path, another machine state


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


def record(path: str | None, curve: dict[int, float], t_draft: float, *, forwards: int = 8,
           category: str = "code", pair: PairInfo = PAIR) -> RequestRecord:
    """A batch-1 request whose forwards cost exactly ``curve`` (n → seconds) on ``path``."""
    ks = [n - 1 for n in curve for _ in range(forwards)]
    accs = list(ks)
    return RequestRecord(
        pair=pair, category=category, policy="fixed", greedy=True, prompt_tokens=10,
        new_tokens=sum(accs) + len(ks), iterations=len(ks),
        proposers=draft(trace=bytes(1 for _ in range(sum(accs) + len(ks))),
                        **blocks(ks, accs)),
        k_schedule=bytes(ks), accepted_schedule=bytes(accs), wall_s=1.0, prefill_s=0.0,
        draft_s=sum(ks) * t_draft, draft_forwards=sum(ks),
        target_s_by_n={n: [t] * forwards for n, t in curve.items()}, trace_kind="greedy",
        created_at=time.time(), path=path)


def _batch1(c):
    """(T_d, T_t(n), source) of batch 1's stored costs."""
    return c.t_draft, c.t_target, c.source


def test_each_path_gets_its_own_costs(url):
    """Eager and static timings of one category in one store: each path's costs are its own,
    never their mean, in the summaries and in ``stored_costs``."""
    with open_store(url) as store:
        store.write([record("eager", EAGER, 0.001) for _ in range(3)]
                    + [record("static", STATIC, 0.02) for _ in range(2)])
        with store.session() as s:
            pid = queries.pair_id(s, PAIR)
            eager = _batch1(stored_costs(s, pid, "code", path="eager", source="live"))
            static = _batch1(stored_costs(s, pid, "code", path="static", source="live"))
            (by_default,) = queries.category_summaries(s, category="code")
            (as_static,) = queries.category_summaries(s, category="code", path="static")
            (as_graphs,) = queries.category_summaries(s, category="code",
                                                      path="static+cuda-graphs")
            assert queries.paths(s, pid) == {"eager": 3, "static": 2}
            assert queries.serving_path(s, pid, "code") == "eager"
            # no path given: the path that served most of the traffic
            assert _batch1(stored_costs(s, pid, "code", source="live"))[:2] == eager[:2]
    assert eager[1] == pytest.approx(EAGER) and eager[0] == pytest.approx(0.001)
    assert static[1] == pytest.approx(STATIC) and static[0] == pytest.approx(0.02)
    assert "eager" in eager[2] and "static" in static[2]
    # counters and acceptance cover every request; timings one path
    assert by_default.requests == as_static.requests == 5
    assert by_default.path == "eager" and by_default.t_target_s_by_n == pytest.approx(EAGER)
    assert as_static.path == "static" and as_static.t_target_s_by_n == pytest.approx(STATIC)
    assert as_static.t_draft_s == pytest.approx(0.02)
    assert as_graphs.t_target_s_by_n == {} and as_graphs.t_draft_s is None


def test_a_probe_serves_only_the_path_it_timed(url):
    with open_store(url) as store:
        store.write([record("eager", EAGER, 0.001) for _ in range(3)])
        with store.begin() as s:
            add_probe(s, PAIR, {"path": "static", "draft_s": 0.02,
                                "target_s_by_n": {str(n): t for n, t in STATIC.items()},
                                "grid": {1: STATIC, 4: {n: 4 * t for n, t in STATIC.items()}},
                                "draft_grid": {1: 0.02, 4: 0.05}})
        with store.session() as s:
            pid = queries.pair_id(s, PAIR)
            eager = _batch1(stored_costs(s, pid, "code", path="eager"))
            static = _batch1(stored_costs(s, pid, "code", path="static"))
            (probe,) = [queries.latest_probe(s, pid)]
            # the batched loop runs eager: a static probe's grid is not its cost source
            batch = queries.batch_costs(s, pid)
            batch_static = queries.batch_costs(s, pid, path="static")
    assert eager[1] == pytest.approx(EAGER) and eager[2] == "live traffic (eager)"
    assert static[1] == pytest.approx(STATIC) and static[2].startswith("probe #")
    assert probe.path == "static"
    assert batch == ({}, {}, "none")
    assert batch_static[2] == "probe" and batch_static[0][4][1] == pytest.approx(0.4)


def test_a_record_with_a_bad_path_is_refused(url):
    with open_store(url) as store:
        for bad in ("", "x" * 65, "eager\x1b[2J", 3):
            with pytest.raises(ValueError, match="path"):
                store.write([record(bad, EAGER, 0.001)])


@pytest.fixture
def models():
    target = tiny("qwen2", sharpen=30.0)
    return target, noisy_copy(target, 0.15)


@pytest.mark.parametrize("options, path", [
    ({}, "eager"),
    ({"static_cache": True, "cuda_graphs": False}, "static"),
    ({"static_cache": True, "cuda_graphs": "emulate"}, "static+emulate"),
])
def test_requests_record_the_path_their_forwards_ran_on(models, tmp_path, options, path):
    url = f"sqlite:///{tmp_path / 'p.db'}"
    spec = autospec.Controller(*models, store=url, **options)
    assert spec.path == path
    spec.generate(prompt(10), max_new_tokens=12, do_sample=False, k=2, eos_token_id=None)
    assert spec.last_stats.path == path
    spec.close()
    with open_store(url) as store, store.session() as s:
        (row,) = queries.recent_requests(s)
        (sm,) = queries.category_summaries(s)
        pid = queries.pair_id(s, spec.telemetry.pair)
        assert queries.paths(s, pid) == {path: 1}
    assert row.path == path and sm.path == path
    assert sm.draft_forwards == spec.last_stats.draft_forwards > 0


def test_the_warm_start_reads_the_path_the_controller_runs(models, tmp_path):
    """A store holding fast eager and slow static timings: a static-cache controller warms
    from the static ones, an eager one from the eager ones (before: from their mix)."""
    from autospec.telemetry import RequestTelemetry

    url = f"sqlite:///{tmp_path / 'w.db'}"
    pinfo = RequestTelemetry(*models, measure_peak=False).pair
    with open_store(url) as store:
        store.write([record("eager", EAGER, 0.001, forwards=16, category="default",
                            pair=pinfo) for _ in range(2)]
                    + [record("static", STATIC, 0.02, forwards=16, category="default",
                              pair=pinfo) for _ in range(2)])
    for options, curve, t_draft in (({}, EAGER, 0.001),
                                    ({"static_cache": True, "cuda_graphs": False}, STATIC, 0.02)):
        spec = autospec.Controller(*models, store=url, policy="auto", **options)
        spec.live_stats("default")
        spec.close()
        costs = spec.costs.at(spec.path)  # this controller's path's batch-1 row, alone
        assert costs.t_target == pytest.approx(curve)
        assert costs.t_draft == pytest.approx(t_draft)
        assert [(row.path, row.batch) for row in spec.costs.rows()] == [(spec.path, 1)]


def test_a_0004_database_is_upgraded_in_place_with_paths_unknown(url):
    """Rows of an 0004 database get path NULL (unknown): they count for acceptance and the
    counters, and no path's costs read them; new rows fold into their path's costs."""
    _create_at(url, "0004")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["pairs", "requests", "probes", "category_stats"])
    assert "path" not in meta.tables["requests"].c and "path" not in meta.tables["probes"].c
    old = record(None, STATIC, 0.02)

    with engine.begin() as conn:
        assert current_revision(conn) == ("0004",)
        pid, row, _ = _insert_legacy(conn, meta.tables["requests"], old,  # schema 0004's
                                     ("path", "ngram", "proposer_schedule", "ngram_trace",
                                      "draft_catch_ups", "suffix", "suffix_trace", "decisions"))
        _legacy_stats(conn, meta.tables["category_stats"], pid, [old])
        conn.execute(insert(meta.tables["probes"]).values(
            pair_id=pid, created_at=row["created_at"],
            payload={"target_s_by_n": {"1": 0.5}, "draft_s": 0.1}))
    engine.dispose()

    with open_store(url) as st:
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),)
        with st.session() as s:
            assert s.scalar(select(Request.path)) is None
            (got,) = queries.recent_requests(s)
            (legacy,) = queries.category_summaries(s)
            assert queries.latest_probe(s, pid).path is None
            assert _batch1(stored_costs(s, pid, "code", path="eager")) == (
                None, {}, "live traffic (eager)")
            assert stored_costs(s, pid, "code").t_target == {}  # no path known
        assert got.path is None
        # only unknown-path requests: the summary shows their sums, labelled unknown
        assert legacy.path is None and legacy.t_target_s_by_n == pytest.approx(STATIC)
        st.write([record("eager", EAGER, 0.001) for _ in range(2)])
        with st.session() as s:
            (sm,) = queries.category_summaries(s)
            costs = _batch1(stored_costs(s, pid, "code", path="eager", source="live"))
            assert s.scalar(select(PairCost.requests)) == 2  # the pair's costs on eager
            assert s.scalar(select(CategoryPath.requests)) == 2
    assert sm.requests == 3 and sm.path == "eager"
    assert sm.t_target_s_by_n == pytest.approx(EAGER)  # not mixed with the unknown ones
    assert costs[1] == pytest.approx(EAGER)


def test_downgrade_to_0004_and_back(url):
    with open_store(url) as store:
        store.write([record("eager", EAGER, 0.001)])
    _downgrade(url, "0004").dispose()
    with open_store(url) as store, store.session() as s:
        (sm,) = queries.category_summaries(s)
        assert sm.path is None and sm.requests == 1  # the path was dropped: unknown again


def test_tune_takes_the_costs_of_the_path_the_traffic_ran_on(tmp_path):
    """Traffic served on the static path, probes of both paths with very different costs:
    tuning replays with the static probe's costs (before: the latest probe, whatever its
    path), and says which path."""
    import random

    from test_tune import CURVE, T_D
    from test_tune import PAIR as TPAIR
    from test_tune import record as tune_record

    from autospec.tune.study import tune

    rng = random.Random(0)
    recs = [tune_record(rng, 0.8, at=1.0e9 + i) for i in range(40)]
    for r in recs:
        r.path = "static"
    slow = {n: 10 * t for n, t in CURVE.items()}
    with open_store(tmp_path / "t.db") as store:
        store.write(recs)
        with store.begin() as s:
            add_probe(s, TPAIR, {"path": "static", "draft_s": T_D,
                                 "target_s_by_n": {str(n): t for n, t in CURVE.items()}})
            add_probe(s, TPAIR, {"path": "eager", "draft_s": 10 * T_D,  # newer, other path
                                 "target_s_by_n": {str(n): t for n, t in slow.items()}})
        (res,) = tune(store, trials=4, families=("fixed",), holdout=0.25, seed=1,
                      write=False)
    assert res.status == "tuned", res.reason
    assert res.costs["t_target_s_by_n"] == pytest.approx(CURVE)
    assert res.costs["t_draft_s"] == pytest.approx(T_D)
    assert res.costs["path"] == "static" and "(static)" in res.costs["source"]


def test_replay_never_interpolates_between_two_paths():
    """Batch 1 measured on the static path, the grid (batch 1 and 4) on the eager one: at
    batch 2 replay reads the grid alone, not a line from static batch 1 to eager batch 4."""
    from autospec.tune.replay import Costs

    grid = {1: {1: 0.010, 2: 0.011}, 4: {1: 0.020, 2: 0.030}}
    mixed = Costs(t_draft=0.05, t_target={1: 0.5, 2: 0.6}, target_grid=grid,
                  draft_grid={1: 0.001, 4: 0.002}, path="static", grid_path="eager")
    target2, draft2 = mixed.at(2)
    assert target2(1) == pytest.approx(0.010 + (0.020 - 0.010) / 3)
    assert draft2 == pytest.approx(0.001 + 0.001 / 3)
    assert mixed.at(1)[0](1) == 0.5  # batch 1 itself is the static path's
    same = Costs.from_description(mixed.describe())
    assert same.other_paths and same.at(2)[0](1) == pytest.approx(target2(1))


def test_the_tuned_policy_follows_a_fetch_function_and_the_policies_import_no_store():
    """``TunedPolicy`` is handed ``fetch(after_id)`` instead of reading SQL itself: any
    source of rows works, and no module of the policy package imports the store."""
    import ast
    from pathlib import Path
    from types import SimpleNamespace

    import autospec.policies as policies
    from autospec.policies import Context, LiveStats, TunedPolicy

    rows = [SimpleNamespace(id=3, category="code", family="fixed", params={"k": 6})]
    seen = []

    def fetch(after_id):
        seen.append(after_id)
        return [r for r in rows if r.id > after_id]

    policy = TunedPolicy(refresh_s=60)
    policy.attach(fetch)
    try:
        assert policy.choose(Context(category="code", k_max=16, live=LiveStats())) == 6
        assert policy.reload() == 0 and seen == [0, 3]
    finally:
        policy.close()
    with pytest.raises(TypeError, match="fetch"):
        TunedPolicy().attach(object())
    for path in Path(policies.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                    a.name for a in node.names]
                assert not any("store" in n for n in names), (path.name, names)


def test_report_and_stats_read_the_probe_of_the_summarys_path(tmp_path, capsys):
    """Static traffic and an eager probe with very different costs: the report's and the
    stats' cost curves are the static requests' own, not the other path's probe."""
    import json

    from autospec.cli import main
    from autospec.report import build_report

    url = f"sqlite:///{tmp_path / 'r.db'}"
    with open_store(url) as store:
        store.write([record("static", STATIC, 0.02, forwards=16) for _ in range(2)])
        with store.begin() as s:
            add_probe(s, PAIR, {"path": "eager", "draft_s": 0.001,
                                "target_s_by_n": {str(n): t for n, t in EAGER.items()}})
        (w,) = build_report(store).workloads
    assert w.verification.t_target_s_by_n == pytest.approx(STATIC)
    assert set(w.verification.source_by_n.values()) == {"requests"}
    assert main(["stats", "--db", url, "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert d["path"] == "static"
    assert d["t_target_s_by_n"] == pytest.approx({str(n): t for n, t in STATIC.items()})


def test_the_measured_speedup_compares_plain_and_speculative_on_one_path(tmp_path):
    """Plain requests served eagerly, speculative ones on the static path: their tokens/s
    ratio is the paths' difference, not speculation's; the report compares within a path."""
    from autospec.report import build_report
    from autospec.store import history

    plain = record("eager", {1: 0.01}, 0.0, forwards=16)  # k = 0 throughout
    spec = record("static", STATIC, 0.02, forwards=16)
    spec.wall_s = 50.0
    with open_store(tmp_path / "m.db") as store:
        store.write([plain, spec])
        with store.session() as s:
            mixed = history.plain_vs_speculative(s)
            split = history.plain_vs_speculative(s, by_path=True)
        (w,) = build_report(store).workloads
    ((key, modes),) = mixed.items()
    assert modes.plain is not None and modes.speculative is not None
    assert {k[2]: (m.plain is not None, m.speculative is not None)
            for k, m in split.items()} == {"eager": (True, False), "static": (False, True)}
    assert w.speedup.measured is None  # no plain requests on the static path to compare
