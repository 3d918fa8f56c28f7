"""Tuning policies on logged traffic: Optuna studies whose objective is the throughput the
simulator replays from stored acceptance traces and measured costs (no models, no GPU).

Per (category, pair) the job:
1. pins a window of traces (request ids first … last; the newest ``max_traces`` in the time
   window), split by time into a tuning part and a held-back part (``holdout``);
2. refuses windows too thin to say anything (fewer than ``min_traces`` traces or
   ``min_positions`` observed positions) and says so, rather than optimising noise;
3. runs an Optuna study over policy families (``fixed``, ``costmodel``, ``bandit``, and
   ``table`` — k per batch-size bucket — where the traffic or the costs have a batch dimension)
   and their parameters; trial 0 is the untuned default (``auto``), so the best is never worse than it on
   the tuning part; the study lives in the same database (Optuna's RDB storage), so several
   workers or processes on one URL share it (a process that joins an existing study replays
   that study's pinned window, so every trial scores the same objective);
4. replays the best and the default on the held-back part, and writes the best parameters to
   ``tuned_params`` with their provenance, where the live ``"tuned"`` policy picks them up.

Greedy traces replay exactly, so for them the objective is deterministic; sampled traces are
replayed with a fixed seed (common random numbers: every trial sees the same draws). Traces
logged at batch B > 1 replay in batches of B with T_t(B, n) (``simulate``), when the costs
have the batch dimension (``costs.stored.stored_costs``: the probe's grid, else live medians).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autospec.costs.stored import stored_costs
from autospec.policies.base import HYBRID, K_LIMIT, batch_bucket
from autospec.policies.params import TUNED
from autospec.policies.table import TablePolicy
from autospec.policies.tuned import ROW_FAMILIES as POLICY_FAMILIES
from autospec.policies.tuned import build_policy
from autospec.traces import MATCH_REACH, UNOBSERVED
from autospec.tune.replay import Costs, SimResult, batch_size_of, simulate

__all__ = ["TuneError", "CategoryResult", "suggest", "evaluate", "tune", "DEFAULT_PARAMS",
           "default_params", "proposer_space", "proposer_sets",
           "load_window", "study_name", "table_spec", "TABLE_BUCKETS"]

log = logging.getLogger(__name__)

FAMILIES = tuple(POLICY_FAMILIES)  # every family a tuned row can name
# the batch-size buckets a "table" trial chooses one k for: 1, 2–3, 4–7, 8–15, 16+ (named by
# their smallest batch size; a bucket above the window's largest batch size takes the k of the
# largest one searched, since replay cannot judge it)
TABLE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16)
# the costmodel parameters a study searches (``suggest``), each with the attribute of
# ``CostModelPolicy`` it sets
SEARCHED_COSTMODEL = TUNED  # the fields of policies.params.Parameters marked tuned


def default_params() -> dict[str, Any]:
    """The untuned ``"auto"`` policy as a trial (trial 0 of every study), read from the policy
    ``"auto"`` builds, so the two cannot drift apart."""
    from autospec.policies.base import auto_policy
    from autospec.policies.costmodel import CostModelPolicy

    auto = auto_policy()
    if not isinstance(auto, CostModelPolicy):
        raise TypeError(f"the auto policy is a {type(auto).__name__}; tune's trial 0 expects "
                        "the cost-model policy")
    flat: dict[str, Any] = {"family": "costmodel"}
    for name in SEARCHED_COSTMODEL:
        flat[f"costmodel.{name}"] = getattr(auto.params, name)
    flat["costmodel.early_stop"] = None  # the auto policy drafts every block to its end
    return flat


DEFAULT_PARAMS: dict[str, Any] = default_params()
# early-stop thresholds searched (None: off). A grid: the live rule compares the draft's top
# probability quantized to 1/254, and traffic rarely tells thresholds 0.05 apart
STOP_GRID: tuple[float | None, ...] = (None, *(round(0.05 * i, 2) for i in range(1, 20)))
# the early-stop threshold is searched when this share of the observed positions carries the
# draft's confidence (traffic logged before schema 0003 carries none)
MIN_CONFIDENCE_SHARE = 0.5


class TuneError(ValueError):
    """A tuning job that cannot run as asked (no traffic, no costs, bad arguments)."""


# -- the search space ---------------------------------------------------------------------

def suggest(trial, k_max: int, families: Sequence[str] = FAMILIES, *,
            early_stop: bool = False,
            table_buckets: Sequence[int] = TABLE_BUCKETS,
            proposers: Sequence[str] = ("draft",)) -> tuple[str, dict]:
    """A policy family and its parameters from an Optuna trial (define-by-run: each family's
    parameters exist only in its branch). Parameter names are prefixed by the family.
    ``early_stop``: also search the draft-side early-stop threshold (off or one of
    ``STOP_GRID``), which replay can only judge on traces that carry the draft's confidence.
    ``table_buckets``: the batch-size buckets a ``table`` trial chooses a k for.
    ``proposers``: the proposers the traces can replay (``proposer_space``; the model
    proposer first, where there is one): with a lookup's trace a fixed trial also chooses its
    proposer (any of them, or "hybrid" with a minimum match) and a cost-model trial which set
    of proposers it weighs (``proposer_sets``)."""
    from autospec.engine.proposers import registered

    classes = registered()
    family = trial.suggest_categorical("family", list(families))
    p: dict[str, Any] = {}
    if family == "fixed":
        p["k"] = trial.suggest_int("fixed.k", 0, k_max)
        if len(proposers) > 1:
            p["proposer"] = trial.suggest_categorical("fixed.proposer", list(proposers))
            if p["proposer"] == "hybrid":
                p["min_match"] = trial.suggest_int("fixed.min_match", 1, MATCH_REACH)
        elif proposers and getattr(classes.get(proposers[0]), "kind", "") != "model":
            p["proposer"] = proposers[0]
    elif family == "table":
        p["table"] = table_spec({b: trial.suggest_int(f"table.k{b}", 0, k_max)
                                 for b in table_buckets})
    elif family == "bandit":
        p["k_max"] = trial.suggest_int("bandit.k_max", 1, k_max)
        p["discount"] = trial.suggest_float("bandit.discount", 0.9, 0.9999)
        p["min_std_fraction"] = trial.suggest_float("bandit.min_std_fraction", 0.01, 0.3,
                                                    log=True)
    else:
        cap = trial.suggest_categorical("costmodel.k_cap", [None, *range(1, k_max)])
        p["k_cap"] = cap
        p["min_gain"] = trial.suggest_float("costmodel.min_gain", 0.0, 0.3)
        p["optimistic"] = trial.suggest_categorical("costmodel.optimistic", [True, False])
        p["stop_rule"] = trial.suggest_categorical("costmodel.stop_rule", [True, False])
        sets = proposer_sets(proposers)
        if sets:
            p["proposers"] = trial.suggest_categorical("costmodel.proposers", sets)
        if any(getattr(classes.get(n), "whole_draft", False) for n in proposers):
            # nothing to choose without a trace of a lookup whose block is its whole draft
            p["suffix_whole"] = trial.suggest_categorical("costmodel.suffix_whole",
                                                          [True, False])
    if early_stop:
        p["early_stop"] = trial.suggest_categorical(f"{family}.early_stop", list(STOP_GRID))
    return family, p


def params_of(flat: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(family, params) from a trial's flat parameter dict (a table trial's k per bucket,
    ``table.k<B>``, becomes its ``table`` spec, as a tuned row stores it)."""
    family = flat["family"]
    prefix = family + "."
    params = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    if family == "table":
        ks = {int(k[1:]): params.pop(k) for k in list(params) if k[:1] == "k" and k[1:].isdigit()}
        params = {"table": table_spec(ks), **params}
    return family, params


def table_spec(k_by_bucket: dict[int, int]) -> str:
    """The ``TablePolicy`` spec running k_by_bucket[b] from batch size b to the next bucket
    (``{1: 4, 4: 2, 16: 0}`` → ``"table:1-3:4,4-15:2,16-:0"``)."""
    return TablePolicy.from_choices(k_by_bucket).name


def bucketed_k(res: SimResult) -> dict[int, int]:
    """The k run most often per batch-size bucket (``traces.batch_bucket``, named by
    its smallest batch size) in a replay."""
    counts: dict[int, Counter] = {}
    for b, c in res.k_counts_by_batch.items():
        counts.setdefault(batch_bucket(b), Counter()).update(c)
    return {b: c.most_common(1)[0][0] for b, c in sorted(counts.items())}


def table_buckets_for(batch_sizes) -> tuple[int, ...]:
    """The buckets of ``TABLE_BUCKETS`` up to the one holding the largest logged batch size
    (rows leave a batch as they finish, so every smaller bucket runs too)."""
    top = max(batch_sizes, default=1)
    return tuple(b for b in TABLE_BUCKETS if b <= top) or (1,)


def evaluate(family: str, params: dict, traces: Sequence, costs: Costs, *, k_max: int,
             seed: int = 0, live: tuple | None = None) -> SimResult:
    """Replay ``traces`` under a fresh policy of ``family``/``params``. ``live``: the
    statistics to start from (``warmed_stats``: category → LiveStats and the pair's cost
    table; copied, not changed), as a serving controller warms them from the store;
    default: cold."""
    policy = build_policy(family, params, seed=seed)
    from autospec.policies.live import copy_lives

    lives, table = (None, None) if live is None else (copy_lives(live[0]), live[1].copy())
    return simulate(traces, policy, costs, k_max=k_max, category=_category_of, seed=seed,
                    live=lives, table=table, batched=costs.batched)


def warmed_stats(traces: Sequence, costs: Costs, *, k_max: int, seed: int = 0) -> tuple:
    """The statistics a controller would hold after serving ``traces`` with the default
    policy (what it warms from the store before the held-back part arrives): category →
    LiveStats, and the pair's ``CostTable``."""

    live: dict = {}
    family, params = params_of(default_params())
    policy = build_policy(family, params, seed=seed)
    table = costs.table()
    simulate(traces, policy, costs, k_max=k_max, category=_category_of, seed=seed,
             live=live, table=table, batched=costs.batched)
    return live, table


def _category_of(row) -> str:
    return getattr(row, "category", "") or "default"


# -- windows ------------------------------------------------------------------------------

@dataclass
class Window:
    """The traces a study scores: request ids first … last, split at ``split_id``."""

    category: str
    pair_id: int
    first_id: int
    last_id: int
    split_id: int  # first id of the held-back part (last_id + 1 if none)
    train: list = field(default_factory=list, repr=False)
    holdout: list = field(default_factory=list, repr=False)

    @property
    def pinned(self) -> dict[str, int]:
        return {"first_id": self.first_id, "last_id": self.last_id, "split_id": self.split_id}

    def describe(self) -> dict[str, Any]:
        rows = self.train + self.holdout
        return {**self.pinned, "since": _iso(rows[0].created_at) if rows else None,
                "until": _iso(rows[-1].created_at) if rows else None,
                "train_traces": len(self.train), "holdout_traces": len(self.holdout)}


def _iso(t) -> str | None:
    return None if t is None else t.isoformat()


def load_window(session, category: str, pair_id: int, *, since=None, until=None,
                max_traces: int = 1000, holdout: float = 0.25,
                pinned: dict[str, int] | None = None) -> Window:
    """The newest ``max_traces`` traces of (category, pair) in [since, until), oldest first,
    split by time; or exactly the ``pinned`` ids of an existing study."""
    from autospec.store import queries

    if pinned:
        rows = list(queries.traces(session, category=category, pair_id=pair_id,
                                   id_range=(pinned["first_id"], pinned["last_id"])))
        split_id = pinned["split_id"]
    else:
        rows = list(queries.traces(session, category=category, pair_id=pair_id, since=since,
                                   until=until, limit=max_traces, newest=True))
        n_hold = int(round(len(rows) * holdout)) if len(rows) >= 2 else 0
        n_hold = min(n_hold, len(rows) - 1) if rows else 0
        split_id = rows[len(rows) - n_hold].id if n_hold else (rows[-1].id + 1 if rows else 0)
    train = [r for r in rows if r.id < split_id]
    hold = [r for r in rows if r.id >= split_id]
    return Window(category, pair_id, rows[0].id if rows else 0, rows[-1].id if rows else 0,
                  split_id, train, hold)


def observed_positions(traces: Sequence) -> int:
    """Positions some proposer's trace observed: the model's (its positions not
    ``UNOBSERVED``), or a lookup's (every generated position: a lookup's trace records
    whether it had a match there too)."""
    def one(t) -> int:
        lookup = any(t.kinds.get(n) == "lookup" and tr for n, tr in t.traces.items())
        return max(sum(1 for v in t.trace if v != UNOBSERVED),
                   t.new_tokens if lookup else 0)

    return sum(one(t) for t in traces)


def confidence_share(traces: Sequence) -> float:
    """The share of observed trace positions whose draft confidence was recorded too."""
    seen = with_conf = 0
    for t in traces:
        conf = getattr(t, "confidence", None)
        for i, v in enumerate(t.trace):
            if v != UNOBSERVED:
                seen += 1
                with_conf += conf is not None and conf[i] != UNOBSERVED
    return with_conf / seen if seen else 0.0


def study_name(pair_id: int, category: str, window: Window, families: Sequence[str],
               k_max: int, costs: Costs, early_stop: bool = False,
               table_buckets: Sequence[int] = ()) -> str:
    """Deterministic for a given window, search space and cost model, so workers started
    together share one study, and a job that would score trials differently never joins it."""
    import hashlib

    from autospec.store.write import category_key

    key = f"{sorted(families)}|{k_max}|{costs.t_draft!r}|{sorted(costs.t_target.items())!r}"
    if early_stop:
        key += f"|stop{STOP_GRID!r}"
    if costs.target_grid:
        key += (f"|grid{sorted((b, sorted(c.items())) for b, c in costs.target_grid.items())!r}"
                f"|{sorted(costs.draft_grid.items())!r}")
    if "table" in families:
        key += f"|table{tuple(table_buckets)!r}"
    if costs.catch_up is not None:
        key += f"|catchup{tuple(costs.catch_up)!r}"
    proposers = proposer_space(window, costs)
    if len(proposers) > 1 or any(costs.t_lookup.values()):
        key += f"|proposers{proposers!r}|{sorted(costs.t_lookup.items())!r}"
    space = hashlib.sha256(key.encode()).hexdigest()[:6]
    return (f"autospec:pair{pair_id}:{category_key(category)[:12]}:"
            f"{window.first_id}-{window.last_id}:{space}")


# -- results ------------------------------------------------------------------------------

@dataclass
class CategoryResult:
    category: str
    pair_id: int
    status: str  # "tuned" or "skipped"
    reason: str = ""
    traces: int = 0
    observed_positions: int = 0
    study: str | None = None
    trials: int = 0
    best_trial: int | None = None
    family: str | None = None
    params: dict[str, Any] | None = None
    train_tokens_per_s: float | None = None
    baseline_train_tokens_per_s: float | None = None
    holdout_tokens_per_s: float | None = None
    baseline_holdout_tokens_per_s: float | None = None
    plain_holdout_tokens_per_s: float | None = None
    holdout_traces: int = 0
    tuned_row_id: int | None = None
    costs: dict[str, Any] | None = None
    seconds: float = 0.0
    kept_default: bool = False  # the best lost on the held-back part: the default is written
    early_stop_searched: bool = False  # the traces carry the draft's confidence
    batch_sizes: dict[int, int] | None = None  # logged batch size → traces in the window
    table_searched: bool = False  # the "table" family was in the search
    # the k the best policy ran most at each batch-size bucket (``batch_bucket``) in the
    # replay of the tuning part: its batch-size → k table, whatever its family
    k_by_batch: dict[int, int] | None = None
    # the proposers searched (``proposer_space``)
    proposers_searched: tuple[str, ...] = ("draft",)
    # the best policy's proposer: a registered proposer's name, "hybrid", or a cost model's
    # set ("draft+suffix", ...)
    proposer: str | None = None
    # each proposer's share of the tokens drafted in the best policy's replay, by name
    shares: dict[str, float | None] = field(default_factory=dict)
    note: str = ""
    provenance: dict[str, Any] | None = None  # what is stored with the parameters

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the job ------------------------------------------------------------------------------

def _storage(url: str, attempts: int = 5):
    """Optuna's RDB storage on the store's database. Two processes meeting a database without
    Optuna's tables both try to create them and one fails; it retries and finds them made."""
    import optuna

    kwargs: dict[str, Any] = {}
    sqlite = url.startswith("sqlite")
    if sqlite:
        # several workers commit trials to one file: wait for the lock rather than fail; the
        # driver's own transaction handling is off, so that _serialize_sqlite's BEGIN counts
        kwargs = {"connect_args": {"timeout": 60, "isolation_level": None}}
    for attempt in range(attempts):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
            if sqlite:
                _serialize_sqlite(storage.engine)
            return storage
        except Exception as e:
            if attempt == attempts - 1:
                raise
            log.info("Optuna storage not ready (%s); retrying", type(e).__name__)
            time.sleep(0.2 * (attempt + 1))


def _serialize_sqlite(engine) -> None:
    """Every transaction on ``engine`` takes SQLite's write lock when it begins.

    Optuna claims a trial by reading its state and writing RUNNING in one transaction, with
    ``SELECT ... FOR UPDATE``, which SQLite ignores; and Python's sqlite3 begins a transaction
    only at the first write, so the read runs outside it. Two processes could then both read
    the enqueued default trial as WAITING and both run it: the second one's tell failed with
    "Cannot tell a COMPLETE trial" (or "Trial#0 has already finished"), and its `autospec tune`
    exited 1. ``BEGIN IMMEDIATE`` makes the read and the write one step; the other process
    waits (up to the connection's timeout) and then sees the trial taken."""
    from sqlalchemy import event

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _objective(window: Window, costs: Costs, k_max: int, families, seed: int,
               early_stop: bool):
    buckets = _table_buckets(window, costs)
    proposers = proposer_space(window, costs)

    def objective(trial) -> float:
        family, params = suggest(trial, k_max, families, early_stop=early_stop,
                                 table_buckets=buckets, proposers=proposers)
        res = evaluate(family, params, window.train, costs, k_max=k_max, seed=seed)
        trial.set_user_attr("speedup", res.speedup)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        return res.tokens_per_s
    return objective


def proposer_of_params(family: str, params: dict, space: Sequence[str]) -> str:
    """The proposer a tuned policy drafts with: a fixed policy's own (None: the model's), a
    cost model's ``proposers`` ("both": every one the request has, weighed per iteration; or
    a set such as "draft+suffix"), else the first of the space (the model proposer's where
    there is one)."""
    first = space[0] if space else "plain"
    if family == "fixed":
        return params.get("proposer") or first
    if family == "costmodel":
        return params.get("proposers", "both" if len(_named(space)) > 1 else first)
    return first


def proposer_space(window: Window, costs: Costs) -> tuple[str, ...]:
    """The proposers a study can replay on this window, in the registry's order with the model
    proposer first: the model where the pair has one, every lookup where some request carries
    its trace (``Proposer.replay``), and "hybrid" (prompt lookup, else the model) where both
    are there."""
    from autospec.engine.proposers import registered

    found = [n for n, cls in sorted(registered().items(), key=lambda i: i[1].kind != "model")
             if (cls.kind != "model" or costs.has_draft)
             and any(cls.replay(r) is not None for r in window.train)]
    lookups = [n for n, cls in registered().items() if cls.kind != "model"]
    if len(found) > 1 and registered()[found[0]].kind == "model" and found[1] == lookups[0]:
        found.insert(2, HYBRID)  # prompt lookup (the first lookup), else the model
    return tuple(found)


def _named(space: Sequence[str]) -> list[str]:
    return [p for p in space if p != HYBRID]


def proposer_sets(space: Sequence[str]) -> list[str]:
    """The sets of proposers a cost-model trial chooses among (its ``proposers``) for a
    proposer space: "both" (every one the request has), each proposer alone, and each pair of
    three — every non-empty set, since the cost model already weighs the proposers of its set
    per iteration and a smaller set only pays where its estimates of one of them mislead,
    which replay tells and the model cannot. Empty with a single proposer (nothing to
    choose)."""
    names = _named(space)
    if len(names) < 2:
        return []
    from itertools import combinations

    subsets = ["+".join(c) for size in range(1, len(names))
               for c in combinations(names, size)]
    return ["both", *subsets]


def _table_buckets(window: Window, costs: Costs) -> tuple[int, ...]:
    """The buckets a table trial searches on this window: those its batches run through when
    they replay at their logged batch sizes (only bucket 1 without batch costs)."""
    if not costs.batched:
        return (1,)
    return table_buckets_for(batch_size_of(r) for r in window.train)


def _optimize(url: str, name: str, window: Window, costs: Costs, *, trials: int,
              timeout: float | None, k_max: int, families, seed: int,
              callback: Callable | None = None, shared: bool = False,
              early_stop: bool = False, worker: int = 0) -> None:
    """One worker: trials until the study holds ``trials`` finished ones (all workers
    together) or ``timeout`` passes. Every worker replays with ``seed`` (one objective for
    the whole study); its sampler's seed is ``seed + worker``, so one job on one window is
    reproducible, and a process that joins a study other processes work on (``shared``, or
    trials already there) mixes in its pid so that it does not repeat their start-up trials."""
    import optuna
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    finished = (TrialState.COMPLETE, TrialState.FAIL)
    study = optuna.load_study(study_name=name, storage=_storage(url))
    done = len(study.get_trials(deepcopy=False, states=finished))
    if done >= trials:
        return
    # the sampler's seed only: every process scores trials with the same replay seed
    sampler_seed = (hash((seed, socket.gethostname(), os.getpid())) % 2**31
                    if shared or done else seed + worker)
    study.sampler = optuna.samplers.TPESampler(seed=sampler_seed)
    callbacks = [MaxTrialsCallback(trials, states=finished)]
    if callback is not None:
        callbacks.append(callback)
    study.optimize(_objective(window, costs, k_max, families, seed, early_stop),
                   timeout=timeout,
                   callbacks=callbacks, gc_after_trial=False)


def _worker(url, name, category, pair_id, pinned, costs, trials, timeout, k_max, families,
            early_stop, seed, worker, ready, go):
    # a child process: its own connections, its own copy of the window
    from autospec.store import open_store

    optuna_quiet()
    with open_store(url) as store, store.session() as s:
        window = load_window(s, category, pair_id, pinned=pinned)
    ready.release()
    go.wait(_START_WAIT_S)
    _optimize(url, name, window, costs, trials=trials, timeout=timeout, k_max=k_max,
              families=families, seed=seed, early_stop=early_stop, worker=worker)


# how long --workers waits for its processes to start before it begins without them
_START_WAIT_S = 120.0


def optuna_quiet() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def tune(store, *, category: str | None = None, pair_id: int | None = None,
         trials: int = 100, timeout: float | None = None, workers: int = 1,
         min_traces: int = 20, min_positions: int = 200, holdout: float = 0.25,
         max_traces: int = 1000, since=None, until=None, study: str | None = None,
         families: Sequence[str] = FAMILIES, k_max: int = 16, seed: int = 0,
         progress: Callable[[str, int, int], None] | None = None,
         write: bool = True, costs_from: str = "auto") -> list[CategoryResult]:
    """Tune every (category, pair) with traffic (or the one asked for). ``store``: an open
    ``autospec.store.Store``. ``progress(category, done, total)`` is called as trials finish.
    ``costs_from``: "probe", "live" or "auto" (the probe if one is stored, else live traffic;
    see ``autospec.costs.stored.stored_costs``).
    Returns one result per workload, tuned or skipped with the reason."""
    import optuna

    from autospec.store import add_tuned_params, queries

    if trials < 1 or workers < 1 or not 0 <= holdout < 1 or min_traces < 1 \
            or not 1 <= k_max <= K_LIMIT:
        raise TuneError("need trials ≥ 1, workers ≥ 1, 0 ≤ holdout < 1, min_traces ≥ 1, "
                        f"1 ≤ k_max ≤ {K_LIMIT}")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise TuneError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        raise TuneError(f"unknown policy families {bad}: choose from {list(FAMILIES)}")
    if study is not None and category is None:
        raise TuneError("--study names one study: give --category too")
    optuna_quiet()
    # Optuna and worker processes connect themselves: the URL with its password
    url = store.engine.url.render_as_string(hide_password=False)
    with store.session() as s:
        workloads = [(sm.category, sm.pair.id, sm.pair) for sm in
                     queries.category_summaries(s, category=category, pair_id=pair_id)]
    if not workloads:
        where = f"category {category!r}" if category else "any category"
        raise TuneError(f"no traffic logged for {where} in {store.url}: serve requests "
                        "through autospec.wrap (with the store on) first, then tune")
    storage = _storage(url)
    results = []
    for cat, pid, pair in workloads:
        t0 = time.perf_counter()
        res = _tune_one(store, storage, url, cat, pid, pair, trials=trials, timeout=timeout,
                        workers=workers, min_traces=min_traces, min_positions=min_positions,
                        holdout=holdout, max_traces=max_traces, since=since, until=until,
                        study=study, families=tuple(families), k_max=k_max, seed=seed,
                        progress=progress, optuna=optuna, costs_from=costs_from)
        if res.status == "tuned" and write:
            family, params = ((params_of(default_params())) if res.kept_default
                              else (res.family, res.params))
            with store.begin() as s:
                res.tuned_row_id = add_tuned_params(
                    s, category=cat, pair_id=pid, family=family, params=params,
                    tokens_per_s=res.train_tokens_per_s,
                    baseline_tokens_per_s=res.baseline_train_tokens_per_s,
                    provenance=res.provenance)
        res.seconds = time.perf_counter() - t0
        results.append(res)
    return results


def catch_up_fit(points, live_t_draft: float | None, t_draft: float
                 ) -> tuple[float, float] | None:
    """The draft model's catch-up C(g) = a + b·g for replay, from logged catch-ups
    ((tokens, seconds), ``queries.catch_ups``), scaled by ``t_draft`` / ``live_t_draft``
    (T_d of the costs replay uses over T_d of the requests that logged them) so that C(g) / T_d
    holds as it was measured; unscaled where the logging requests measured no T_d. None
    without a catch-up."""
    from autospec.costs.rules import catch_up_line, catch_up_sums

    line = catch_up_line(catch_up_sums(points))
    if line is None:
        return None
    scale = t_draft / live_t_draft if live_t_draft and t_draft > 0 else 1.0
    return line[0] * scale, line[1] * scale


def replay_costs(session, pair_id: int, category: str, pair, *, costs_from: str = "auto"
                 ) -> tuple[Costs, str] | str:
    """The costs replay prices a category's logged traffic by, and where they came from; or
    why there are none. Batch 1's from the path the category's traffic ran on (never
    another's), batch > 1 from the batched loop's path, as the report reads them and the
    controller starts from (one source throughout where ``costs_from`` names one); the
    lookups' host time as their requests measured it; the draft model's catch-up fitted to
    what the pair logged (else to what the probe timed), at the ratio to T_d those same
    requests (that probe) measured."""
    from autospec.store import queries
    from autospec.telemetry import NO_DRAFT

    stored = stored_costs(session, pair_id, category, source=costs_from)
    path, t_draft, t_target, cost_source = (stored.path, stored.t_draft, stored.t_target,
                                            stored.source)
    grid, draft_grid = stored.grid, stored.draft_grid
    has_draft = pair.draft != NO_DRAFT
    if not has_draft:
        t_draft = 0.0  # lookups alone: their time is t_lookup
    if (has_draft and not t_draft) or 1 not in t_target or len(t_target) < 2:
        return (f"no usable costs for this pair from {cost_source} (need T_t(1), T_t(n>1) and "
                "T_d): run `autospec probe` on this machine, or serve more traffic with k = 0 "
                "and k > 0")
    same = path == queries.BATCH_PATH  # else the grid keeps its own batch 1 (simulate.Costs)
    catch_up = (catch_up_fit(stored.catch_up, stored.catch_up_t_draft, float(t_draft))
                if has_draft else None)
    costs = Costs(t_draft=float(t_draft), t_target=t_target,
                  target_grid={b: c for b, c in grid.items() if b > 1 or not same},
                  draft_grid={b: d for b, d in draft_grid.items() if b > 1 or not same},
                  path=path, grid_path=queries.BATCH_PATH, t_lookup=stored.t_lookup,
                  has_draft=has_draft, catch_up=catch_up)
    if has_draft:
        n = len(stored.catch_up)
        cost_source += ("; draft catch-up: none logged or probed, not charged" if not catch_up
                        else f"; draft catch-up: {n} logged" if stored.catch_up_source == "logged"
                        else f"; draft catch-up: the probe's ({n} sizes)")
    if costs.batched:
        cost_source += f"; batch > 1: {stored.grid_source}"
    return costs, cost_source


def _tune_one(store, storage, url, cat, pid, pair, *, trials, timeout, workers, min_traces,
              min_positions, holdout, max_traces, since, until, study, families, k_max, seed,
              progress, optuna, costs_from) -> CategoryResult:
    from optuna.trial import TrialState


    res = CategoryResult(category=cat, pair_id=pid, status="skipped")
    name = study
    existing = None
    if name is not None:
        try:
            existing = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            existing = None
    with store.session() as s:
        pinned = existing.user_attrs.get("window") if existing is not None else None
        window = load_window(s, cat, pid, since=since, until=until, max_traces=max_traces,
                             holdout=holdout, pinned=pinned)
        got = replay_costs(s, pid, cat, pair, costs_from=costs_from)
    res.traces = len(window.train) + len(window.holdout)
    res.holdout_traces = len(window.holdout)
    res.observed_positions = observed_positions(window.train)
    if len(window.train) < min_traces or res.observed_positions < min_positions:
        res.reason = (f"{len(window.train)} traces / {res.observed_positions} observed "
                      f"positions to tune on (need ≥ {min_traces} and ≥ {min_positions}): "
                      "too little to tell policies apart, log more traffic first")
        return res
    if isinstance(got, str):
        res.reason = got
        return res
    costs, cost_source = got
    if "table" in families and not costs.batched:
        # a table differs from a fixed k only where batches replay at their batch sizes
        families = tuple(f for f in families if f != "table")
        if not families:
            res.reason = ("the table family needs costs at batch > 1 (T_t(B, n)): run "
                          "`autospec probe --batch 1,2,4,8,16,32`")
            return res
    early_stop = confidence_share(window.train) >= MIN_CONFIDENCE_SHARE
    name = name or study_name(pid, cat, window, families, k_max, costs, early_stop,
                              _table_buckets(window, costs))
    res.study = name
    st = optuna.create_study(study_name=name, storage=storage, direction="maximize",
                             load_if_exists=True)
    attrs = st.user_attrs
    if "window" not in attrs:
        st.set_user_attr("window", window.pinned)
        st.set_user_attr("costs", {**costs.describe(), "source": cost_source})
        st.set_user_attr("families", list(families))
        st.set_user_attr("category", cat)
        st.set_user_attr("pair_id", pid)
        st.set_user_attr("early_stop_space", early_stop)
        if "costmodel" in families:
            st.enqueue_trial(default_params())  # trial 0: the untuned default
    else:  # joining: every trial of a study scores the same window with the same costs
        if attrs["window"] != window.pinned:
            with store.session() as s:
                window = load_window(s, cat, pid, pinned=attrs["window"])
        pinned_costs = attrs.get("costs")
        if pinned_costs:
            cost_source = pinned_costs["source"]
            costs = Costs.from_description(pinned_costs)
        families = tuple(attrs.get("families", families))
        early_stop = bool(attrs.get("early_stop_space", False))
    res.early_stop_searched = early_stop
    res.table_searched = "table" in families
    res.costs = {**costs.describe(), "source": cost_source}
    sizes = Counter(batch_size_of(r) for r in window.train + window.holdout)
    res.batch_sizes = dict(sorted(sizes.items()))
    notes = []
    if max(sizes) > 1 and not costs.batched:
        notes.append(f"traces logged at batch sizes {sorted(b for b in sizes if b > 1)} "
                     "replayed one request at a time (batch 1): no T_t(B, n) at batch > 1 "
                     f"from {'a probe or live traffic' if costs_from == 'auto' else costs_from}"
                     "; run `autospec probe --batch 1,2,4,8,16,32`")
    finished = (TrialState.COMPLETE, TrialState.FAIL)

    def count(study, _trial=None):
        if progress is not None:
            progress(cat, len(study.get_trials(deepcopy=False, states=finished)), trials)

    procs = []
    if workers > 1:
        # the workers start together: a spawned process takes seconds to import what it needs,
        # and a short study would otherwise be over before it joined
        ctx = multiprocessing.get_context("spawn")
        ready, go = ctx.Semaphore(0), ctx.Event()
        for w in range(1, workers):
            p = ctx.Process(target=_worker, args=(url, name, cat, pid, window.pinned, costs,
                                                  trials, timeout, k_max, families,
                                                  early_stop, seed, w,
                                                  ready, go), daemon=True)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + _START_WAIT_S
        started = 0
        while started + sum(not p.is_alive() for p in procs) < len(procs):  # dead: failed
            if ready.acquire(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                started += 1
            elif time.monotonic() >= deadline:
                log.warning("autospec tune: %d of %d worker processes not ready after %.0f s; "
                            "starting without waiting", len(procs) - started, len(procs),
                            _START_WAIT_S)
                break
        go.set()
    try:
        count(st)
        _optimize(url, name, window, costs, trials=trials, timeout=timeout, k_max=k_max,
                  families=families, seed=seed, callback=count, shared=study is not None,
                  early_stop=early_stop)
    finally:
        for p in procs:
            p.join()
        bad = [p.exitcode for p in procs if p.exitcode]
        if bad:
            log.warning("autospec tune: %d worker process(es) failed (exit codes %s); the "
                        "study kept the trials they finished", len(bad), bad)
    st = optuna.load_study(study_name=name, storage=storage)
    done = st.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    res.trials = len(done)
    if not done:
        res.reason = "no trial finished (timeout too short?)"
        return res
    best = st.best_trial
    family, params = params_of(best.params)
    base_family, base_params = params_of(default_params())
    res.family, res.params, res.best_trial = family, params, best.number
    res.train_tokens_per_s = float(best.value)
    res.baseline_train_tokens_per_s = evaluate(base_family, base_params, window.train, costs,
                                               k_max=k_max, seed=seed).tokens_per_s
    best_replay = evaluate(family, params, window.train, costs, k_max=k_max, seed=seed)
    res.k_by_batch = bucketed_k(best_replay)
    res.proposers_searched = proposer_space(window, costs)
    res.proposer = proposer_of_params(family, params, res.proposers_searched)
    drafted = sum(d for d, _a in best_replay.by_proposer.values())
    res.shares = {n: best_replay.by_proposer.get(n, [0, 0])[0] / drafted if drafted else None
                  for n in _named(res.proposers_searched)}
    holdout_figures = None
    if window.holdout:
        # both start from the statistics the tuning part left, as a live controller would
        warm = warmed_stats(window.train, costs, k_max=k_max, seed=seed)
        tuned_h = evaluate(family, params, window.holdout, costs, k_max=k_max, seed=seed,
                           live=warm)
        base_h = evaluate(base_family, base_params, window.holdout, costs, k_max=k_max,
                          seed=seed, live=warm)
        res.holdout_tokens_per_s = tuned_h.tokens_per_s
        res.baseline_holdout_tokens_per_s = base_h.tokens_per_s
        res.plain_holdout_tokens_per_s = (tuned_h.tokens / tuned_h.plain_seconds
                                          if tuned_h.plain_seconds else None)
        holdout_figures = {"tuned_tokens_per_s": tuned_h.tokens_per_s,
                           "baseline_tokens_per_s": base_h.tokens_per_s,
                           "plain_tokens_per_s": res.plain_holdout_tokens_per_s,
                           "tuned_speedup": tuned_h.speedup, "baseline_speedup": base_h.speedup,
                           "traces": len(window.holdout)}
    res.status = "tuned"
    if (res.holdout_tokens_per_s is not None and res.baseline_holdout_tokens_per_s
            and res.holdout_tokens_per_s < res.baseline_holdout_tokens_per_s):
        # it won on the tuning part and lost on traffic it had not seen: an overfit. What
        # goes into force is the default; the result and the study stay for inspection.
        res.kept_default = True
        notes.insert(0, f"the best trial lost on the held-back traffic "
                     f"({res.holdout_tokens_per_s / res.baseline_holdout_tokens_per_s:.3f}× "
                     "the default): the default stays in force")
    res.note = "; ".join(notes)
    res.provenance = {
        "study": name, "trial": best.number, "trials": res.trials,
        "storage": store.url, "window": window.describe(),
        "pair": {"target": pair.target, "draft": pair.draft, "dtype": pair.dtype},
        "hardware": pair.hardware, "objective": "simulated tokens/s on the tuning window",
        "baseline": "auto (untuned cost-model policy)", "holdout": holdout_figures,
        "costs": res.costs, "k_max": k_max, "families": list(families),
        "early_stop_searched": res.early_stop_searched,
        "batch_sizes": res.batch_sizes, "table_searched": res.table_searched,
        "k_by_batch": res.k_by_batch,
        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kept_default": res.kept_default,
        "best": {"family": family, "params": params} if res.kept_default else None,
    }
    if not math.isfinite(res.train_tokens_per_s):
        res.status, res.reason = "skipped", "the simulation produced no tokens"
    return res
