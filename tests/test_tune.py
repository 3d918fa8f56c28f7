"""Tuning on logged traffic: real Optuna studies in a real SQLite store, synthetic traces whose
optimum is known in closed form, and the live "tuned" policy following the store."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autospec.costs.price import best_k
from autospec.policies import Context, LiveStats, TunedPolicy, as_policy, build_policy
from autospec.policies.base import early_stop_of
from autospec.store import PairInfo, RequestRecord, add_probe, add_tuned_params, open_store, queries
from autospec.traces import TRACE_GREEDY, TRACE_SAMPLED
from autospec.tune.replay import Costs
from autospec.tune.study import DEFAULT_PARAMS, TuneError, evaluate, load_window, params_of, tune

from records import draft
from test_store import fresh_url

PAIR = PairInfo("synthetic-target", "synthetic-draft", "float32", "cpu: test")
T_D = 0.02
CURVE = {n: 0.1 + 0.004 * (n - 1) for n in range(1, 17)}  # memory-bound: nearly flat


def record(rng: random.Random, alpha: float, *, n: int = 96, category: str = "code",
           at: float = 1.0e9, pair: PairInfo = PAIR,
           confidence: tuple[int, int] | None = None, sampled: bool = False) -> RequestRecord:
    """A request whose greedy trace is i.i.d. Bernoulli(alpha) (served at k = 0), or with
    ``sampled`` a sampled trace of β ~ U(alpha ± 0.15) per position.
    ``confidence``: the draft's recorded confidence bytes where it is (right, wrong)."""
    if sampled:
        trace = bytes(round(254 * min(1.0, max(0.0, alpha + rng.uniform(-0.15, 0.15))))
                      for _ in range(n))
    else:
        trace = bytes(1 if rng.random() < alpha else 0 for _ in range(n))
    conf = None if confidence is None else bytes(confidence[0] if v else confidence[1]
                                                 for v in trace)
    return RequestRecord(
        pair=pair, category=category, policy="off", greedy=not sampled, prompt_tokens=16,
        new_tokens=n, iterations=n, proposers=draft(trace=trace, confidence=conf),
        k_schedule=bytes(n), accepted_schedule=bytes(n),
        wall_s=n * CURVE[1], prefill_s=0.0, draft_s=0.0, draft_forwards=0,
        target_s_by_n={1: [CURVE[1]] * 4}, trace_kind=TRACE_SAMPLED if sampled else TRACE_GREEDY,
        created_at=at, path="eager")


def make_store(path: Path | str, traffic: dict[str, tuple[float, int]], seed: int = 0,
               confidence: tuple[int, int] | None = None, sampled: bool = False):
    """traffic: category → (alpha, requests). Costs from a probe: T_d and the flat curve."""
    rng = random.Random(seed)
    store = open_store(path)
    recs = []
    for cat, (alpha, count) in traffic.items():
        recs += [record(rng, alpha, category=cat, at=1.0e9 + i, confidence=confidence,
                        sampled=sampled) for i in range(count)]
    store.write(recs)
    with store.begin() as s:
        add_probe(s, PAIR, {"path": "eager", "target_s_by_n": {str(n): t for n, t in CURVE.items()},
                            "draft_s": T_D})
    return store


@pytest.mark.parametrize("alpha", [0.85, 0.6, 0.2])
def test_tuning_finds_the_known_optimum(tmp_path, alpha):
    """i.i.d. acceptance α and known costs: the best fixed k is argmax S(k) in closed form
    (k = 0 when α is low); the study must find it and score it at S(k*) · plain tokens/s."""
    k_star, s_star = best_k(alpha, T_D, CURVE, 16)
    with make_store(tmp_path / "s.db", {"code": (alpha, 80)}) as store:
        (res,) = tune(store, trials=40, families=("fixed",), holdout=0.25, seed=1)
    assert res.status == "tuned", res.reason
    assert res.family == "fixed"
    # neighbouring k can tie within sampling noise of 60 finite traces: accept them only if
    # their closed-form S is within 1 % of the optimum
    found = res.params["k"]
    assert found == k_star or best_k_value(alpha, found) >= 0.99 * s_star, (found, k_star)
    plain = 1 / CURVE[1]
    assert res.train_tokens_per_s == pytest.approx(s_star * plain, rel=0.06)
    assert res.holdout_traces == 20 and res.holdout_tokens_per_s is not None


def test_early_stop_threshold_is_searched_where_traces_carry_the_drafts_confidence(tmp_path):
    """The draft is sure (0.98) where it is right and unsure (0.24) where it is wrong: the
    study finds a threshold between the two and beats the best policy without one, which is
    all a study on traces without confidences can search."""
    traffic = {"code": (0.6, 60)}
    with make_store(tmp_path / "c.db", traffic, confidence=(250, 60)) as store:
        (res,) = tune(store, trials=60, families=("fixed",), seed=0)
        with store.session() as s:
            (row,) = queries.tuned_params(s)
    with make_store(tmp_path / "b.db", traffic) as store:
        (blind,) = tune(store, trials=40, families=("fixed",), seed=0)
    assert res.early_stop_searched and not blind.early_stop_searched
    assert "early_stop" not in blind.params
    assert res.params["early_stop"] is not None and 60 / 254 < res.params["early_stop"] <= 250 / 254
    assert res.train_tokens_per_s > 1.05 * blind.train_tokens_per_s
    assert row.provenance["early_stop_searched"] is True
    # the row holds the result, or (where it lost on the held-back part, here within 0.1 % of
    # auto, which stops its blocks by the same confidences) the default, naming the result
    if res.kept_default:
        assert res.holdout_tokens_per_s >= 0.99 * res.baseline_holdout_tokens_per_s
        assert row.family == "costmodel" and row.provenance["best"]["params"] == res.params
    else:
        assert row.params == res.params
    # the live policy built from the result stops drafting at that threshold, for that category
    policy = build_policy("fixed", res.params)
    assert early_stop_of(policy, "code") == res.params["early_stop"]


def best_k_value(alpha: float, k: int) -> float:
    from autospec.costs.price import speedup

    return speedup(k, alpha, T_D, CURVE)


def test_tuned_beats_or_matches_the_default_and_is_stored_with_provenance(tmp_path):
    with make_store(tmp_path / "s.db", {"code": (0.85, 60), "chat": (0.25, 60)}) as store:
        results = {r.category: r for r in tune(store, trials=30, seed=0)}
        assert set(results) == {"code", "chat"}
        for r in results.values():
            assert r.status == "tuned", r.reason
            # trial 0 is the default, so the best on the tuning part is never worse
            assert r.train_tokens_per_s >= r.baseline_train_tokens_per_s - 1e-9
        with store.session() as s:
            rows = {t.category: t for t in queries.tuned_params(s)}
            pid = queries.pair_id(s, PAIR)
        assert set(rows) == {"code", "chat"}
        for cat, r in results.items():
            row = rows[cat]
            assert row.pair_id == pid
            best = {"family": r.family, "params": r.params}
            if r.kept_default:  # lost on the held-back part: the default is in force
                assert r.holdout_tokens_per_s < r.baseline_holdout_tokens_per_s
                assert (row.family, row.params) == params_of(DEFAULT_PARAMS)
                assert row.provenance["best"] == best
            else:
                assert r.holdout_tokens_per_s >= r.baseline_holdout_tokens_per_s
                assert {"family": row.family, "params": row.params} == best
                assert row.provenance["best"] is None
        row = rows["code"]
        prov = row.provenance
        assert prov["study"] == results["code"].study and prov["trial"] == results["code"].best_trial
        assert prov["hardware"] == PAIR.hardware and prov["pair"]["target"] == PAIR.target
        assert prov["window"]["train_traces"] == 45 and prov["window"]["holdout_traces"] == 15
        assert prov["holdout"]["tuned_tokens_per_s"] == pytest.approx(
            results["code"].holdout_tokens_per_s)
        # the study is a real Optuna study in the same database
        study = optuna.load_study(study_name=prov["study"], storage=store.engine.url
                                  .render_as_string(hide_password=False))
        assert len(study.trials) == 30 and study.trials[0].params["family"] == "costmodel"


def test_thin_or_empty_traffic_is_refused_not_optimised(tmp_path):
    with open_store(tmp_path / "empty.db") as store:
        with pytest.raises(TuneError, match="no traffic logged"):
            tune(store, trials=5)
    with make_store(tmp_path / "thin.db", {"rare": (0.8, 8)}) as store:
        (res,) = tune(store, trials=5)
        assert res.status == "skipped"
        assert "6 traces" in res.reason and "need ≥ 20" in res.reason
        with store.session() as s:
            assert queries.tuned_params(s) == []  # nothing written for a skipped workload


def _claim_enqueued(url, go, out):
    # a child process: claim enqueued trials through autospec's storage until none is left
    from autospec.tune.study import _storage

    study = optuna.load_study(study_name="claims", storage=_storage(url))
    go.wait(60)
    told = []
    try:
        while True:
            trial = study.ask()
            x = trial.suggest_int("x", 0, 10**9)  # an enqueued one's fixed x, else sampled
            if x >= 40:  # the queue is empty: this one was sampled
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                break
            study.tell(trial, x)
            told.append(x)
    except Exception as e:  # a trial another process had claimed too
        out.put(f"{type(e).__name__}: {e}")
        return
    out.put(told)


def test_processes_claim_each_enqueued_trial_once_on_sqlite(tmp_path):
    """Optuna claims a WAITING trial with SELECT ... FOR UPDATE, which SQLite ignores: without
    autospec's BEGIN IMMEDIATE, two `autospec tune` processes both ran the enqueued default
    trial and the second one's tell failed ("Cannot tell a COMPLETE trial"). Four processes
    draining forty enqueued trials at once each claim distinct trials, all forty between them."""
    import multiprocessing

    from autospec.tune.study import _storage

    url = f"sqlite:///{tmp_path / 'claims.db'}"
    study = optuna.create_study(study_name="claims", storage=_storage(url))
    for x in range(40):
        study.enqueue_trial({"x": x})
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_claim_enqueued, args=(url, go, out)) for _ in range(4)]
    for p in procs:
        p.start()
    time.sleep(3)  # let them import optuna and load the study, then start them together
    go.set()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [r for r in results if isinstance(r, str)]
    assert errors == []
    told = sorted(x for r in results for x in r)
    assert told == list(range(40))  # each once: none lost, none run twice


def test_two_processes_share_one_study_on_one_sqlite_url(tmp_path):
    """`autospec tune` processes with the same --study on one SQLite file: run together they
    stop at the asked-for count between them (not twice it); one that joins later replays the
    same pinned window and costs and adds its own trials to the same study."""
    db = tmp_path / "shared.db"
    make_store(db, {"code": (0.8, 200)}).close()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def cmd(study, trials):
        return [sys.executable, "-m", "autospec.cli", "tune", "--db", str(db), "--category",
                "code", "--study", study, "--trials", str(trials), "--json"]

    def run(*cmds):
        procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for c in cmds]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-2000:]
        return [json.loads(out) for out, _err in outs]

    def complete(study):
        st = optuna.load_study(study_name=study, storage=f"sqlite:///{db}")
        return st, [t for t in st.trials if t.state == optuna.trial.TrialState.COMPLETE]

    run(cmd("together", 24), cmd("together", 24))
    _st, done = complete("together")
    assert 24 <= len(done) <= 26  # each process stops at the shared limit (± one in flight)

    (first,) = run(cmd("joined", 10))
    (second,) = run(cmd("joined", 20))
    st, done = complete("joined")
    assert len(done) == 20 and len({t.user_attrs["worker"] for t in done}) == 2
    # the joiner scored the window and costs the study pinned, not ones of its own
    assert first[0]["study"] == second[0]["study"] == "joined"
    assert first[0]["costs"] == second[0]["costs"] and first[0]["traces"] == second[0]["traces"]
    assert second[0]["train_tokens_per_s"] >= first[0]["train_tokens_per_s"]
    assert st.best_value == pytest.approx(second[0]["train_tokens_per_s"])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_workers_option_runs_several_processes(tmp_path, backend):
    """--workers: processes on one study in the store's own database (PostgreSQL: a fleet's)."""
    url, cleanup = fresh_url(backend, tmp_path)
    try:
        _workers_share_a_study(url)
    finally:
        cleanup()


def _workers_share_a_study(url: str) -> None:
    with make_store(url, {"code": (0.8, 200)}, sampled=True) as store:
        (res,) = tune(store, trials=16, workers=2, seed=3)
        url = store.engine.url.render_as_string(hide_password=False)
        with store.session() as s:
            window = load_window(s, "code", res.pair_id, pinned=res.provenance["window"])
    study = optuna.load_study(study_name=res.study, storage=url)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len({t.user_attrs["worker"] for t in done}) == 2
    assert res.trials == len(done) >= 16
    # one objective for the whole study: sampled traces replay with random draws, and every
    # worker's score is the job's own replay (seed 3) of that trial's parameters
    costs = Costs(res.costs["t_draft_s"], res.costs["t_target_s_by_n"])
    for t in done[:6]:
        family, params = params_of(t.params)
        again = evaluate(family, params, window.train, costs, k_max=16, seed=3)
        assert t.value == pytest.approx(again.tokens_per_s), t.user_attrs["worker"]


def test_tuned_policy_reloads_new_parameters_without_restart(tmp_path):
    with make_store(tmp_path / "p.db", {"code": (0.8, 2)}) as store:
        with store.session() as s:
            pid = queries.pair_id(s, PAIR)
        policy = as_policy("tuned")
        assert isinstance(policy, TunedPolicy)
        policy.refresh_s = 0.05
        ctx = Context(category="code", k_max=16, live=LiveStats())
        untuned = policy.choose(ctx)  # nothing tuned yet: the default (auto) policy
        assert untuned == as_policy("auto").choose(ctx)
        policy.attach(queries.tuned_fetcher(store, PAIR))
        try:
            with store.begin() as s:
                add_tuned_params(s, category="code", pair_id=pid, family="fixed",
                                 params={"k": 7}, tokens_per_s=1.0, baseline_tokens_per_s=None,
                                 provenance={"study": "manual"})
            assert policy.reload() == 1
            assert policy.choose(ctx) == 7
            assert policy.choose(Context(category="chat", k_max=16, live=LiveStats())) == \
                untuned  # another category keeps the default
            with store.begin() as s:  # a newer result: the poller applies it by itself
                add_tuned_params(s, category="code", pair_id=pid, family="fixed",
                                 params={"k": 2}, tokens_per_s=1.0, baseline_tokens_per_s=None,
                                 provenance={"study": "manual"})
            deadline = time.monotonic() + 10
            while policy.choose(ctx) != 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert policy.choose(ctx) == 2
            assert policy.params["code"].params == {"k": 2}
            assert policy.early_stop_for("code") is None
            with store.begin() as s:  # a tuned early-stop threshold, for this category only
                add_tuned_params(s, category="code", pair_id=pid, family="fixed",
                                 params={"k": 5, "early_stop": 0.45}, tokens_per_s=1.0,
                                 baseline_tokens_per_s=None, provenance={})
            assert policy.reload() == 1 and policy.choose(ctx) == 5
            assert policy.early_stop_for("code") == 0.45
            assert policy.early_stop_for("chat") is None
            with store.begin() as s:  # a row this version cannot apply is ignored, logged
                add_tuned_params(s, category="code", pair_id=pid, family="fixed",
                                 params={"k": 3, "warp": 9}, tokens_per_s=1.0,
                                 baseline_tokens_per_s=None, provenance={})
            policy.reload()
            assert policy.choose(ctx) == 5
        finally:
            policy.close()


def test_a_result_that_loses_on_held_back_traffic_keeps_the_default(tmp_path):
    """Drift: the tuning part is easy (α 0.9), the held-back part hard (α 0.05). A fixed large k
    wins the first and loses the second to the adaptive default: the default stays in force."""
    rng = random.Random(5)
    with open_store(tmp_path / "drift.db") as store:
        store.write([record(rng, 0.9, at=1.0e9 + i) for i in range(60)]
                    + [record(rng, 0.05, at=2.0e9 + i) for i in range(20)])
        with store.begin() as s:
            add_probe(s, PAIR, {"path": "eager", "target_s_by_n": {str(n): t for n, t in CURVE.items()},
                                "draft_s": T_D})
        (res,) = tune(store, trials=12, families=("fixed",), seed=0)
        assert res.family == "fixed" and res.params["k"] >= 4
        assert res.holdout_tokens_per_s < res.baseline_holdout_tokens_per_s
        assert res.kept_default and "held-back" in res.note
        with store.session() as s:
            (row,) = queries.tuned_params(s)
        assert (row.family, row.params["min_gain"]) == ("costmodel", 0.0)  # the default
        assert row.provenance["kept_default"] is True
        assert row.provenance["best"] == {"family": "fixed", "params": res.params}


@pytest.mark.parametrize("command", ["tune", "stats", "report"])
def test_an_unusable_store_url_is_a_clear_error_with_status_2(command, capsys):
    from autospec.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--db", "sqlite:////proc/autospec-no-such-dir/x.db"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("autospec: error: ") and err.count("\n") == 1
    # tune writes: it would create the store; stats and report only read: nothing there
    assert ("cannot create the directory for the store file" if command == "tune"
            else "no store at '/proc/autospec-no-such-dir/x.db'") in err


def test_trial_zero_is_read_from_the_auto_policy(monkeypatch):
    """tune's untuned default is derived from what ``"auto"`` builds, not copied by hand: every
    costmodel parameter a study searches is trial 0's value, and changing the auto policy
    changes trial 0."""
    import optuna

    from autospec.policies import base
    from autospec.policies.costmodel import CostModelPolicy
    from autospec.tune import study as tune_mod

    trial = optuna.trial.FixedTrial(tune_mod.default_params())
    assert tune_mod.suggest(trial, k_max=16, families=["costmodel"]) is not None
    searched = {k for k in trial.params if k.startswith("costmodel.")}
    # suffix_whole is searched only where the traces replay suffix decoding
    assert searched == {f"costmodel.{n}" for n in tune_mod.SEARCHED_COSTMODEL
                        if n != "suffix_whole"}
    with_suffix = optuna.trial.FixedTrial({**tune_mod.default_params(),
                                           "costmodel.proposers": "both"})
    tune_mod.suggest(with_suffix, k_max=16, families=["costmodel"],
                     proposers=("draft", "ngram", "suffix"))
    assert with_suffix.params["costmodel.suffix_whole"] is True
    family, params = params_of(tune_mod.default_params())
    built, auto = tune_mod.build_policy(family, params), base.auto_policy()
    for name in tune_mod.SEARCHED_COSTMODEL:
        assert getattr(built.params, name) == getattr(auto.params, name), name
    monkeypatch.setattr(base, "auto_policy", lambda: CostModelPolicy(name="auto", min_gain=0.07,
                                                                      k_cap=9))
    d = tune_mod.default_params()
    assert (d["costmodel.min_gain"], d["costmodel.k_cap"]) == (0.07, 9)
