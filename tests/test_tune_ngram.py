"""Proposer choice learned from logged traffic: the n-gram proposer's trace replays what live
verification did (greedy, exactly), and ``autospec tune`` picks the proposer per category —
the n-gram where the output copies the input and the draft model is weak there, the draft
model where nothing repeats. Real SQLite stores, real Optuna studies, real tiny models for
the live part."""

from __future__ import annotations

import random

import pytest
import torch
from test_ngram import _repetitive

import autospec
from autospec.ngram import encode_trace_value
from autospec.policies import as_policy
from autospec.store import PairInfo, RequestRecord, add_probe, open_store, queries
from autospec.traces import NGRAM_NONE, TRACE_GREEDY
from autospec.tune.replay import Costs, simulate
from autospec.tune.study import tune

from conftest import noisy_copy, tiny
from records import draft, lookup


@pytest.mark.parametrize("policy", ["ngram:4", "hybrid:3:1", "fixed:3"])
def test_replaying_the_stored_traces_gives_what_the_live_loop_did(tmp_path, policy):
    target = tiny("llama", layers=2, seed=5)
    draft = noisy_copy(target, 0.1)
    url = f"sqlite:///{tmp_path / 'live.db'}"
    spec = autospec.Controller(target, draft, store=url, policy=policy)
    live = []
    for seed in range(3):
        ids = _repetitive(seed)
        spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                      do_sample=False, category="copy")
        live.append(spec.last_stats)
    spec.close()
    with open_store(url) as store, store.session() as s:
        rows = list(queries.traces(s))
    assert len(rows) == 3 and all(r.ngram_trace for r in rows)
    costs = Costs(t_draft=0.01, t_target={1: 0.1, 17: 0.2})
    for row, st in zip(rows, live):
        res = simulate([row], as_policy(policy), costs, k_max=16)
        assert (res.proposer("ngram").proposed, res.proposer("ngram").accepted) == (st.proposer("ngram").proposed, st.proposer("ngram").accepted)
        assert (res.drafted, res.accepted) == (st.drafted, st.accepted)
        assert res.iterations == st.iterations and res.unobserved_hits == 0
        assert bytes(row.proposer_schedule or bytes(st.iterations)) == bytes(
            1 if p == "ngram" else 0 for p in st.proposer_schedule)
    assert sum(st.proposer("ngram").proposed for st in live) > 0 or policy == "fixed:3"
    # the n-gram's statistics, pooled and per match length, learned live (its own blocks and
    # its shadow where it did not draft) are what replaying the traces learns
    lives: dict = {}
    simulate(rows, as_policy(policy), costs, k_max=16, live=lives, category="copy")
    got, want = spec.live["copy"], lives["copy"]
    assert sorted(got.by_proposer["ngram"].by_match) == sorted(want.by_proposer["ngram"].by_match) != []
    assert got.counts("ngram")[1] == pytest.approx(want.counts("ngram")[1])
    assert got.counts("ngram")[0] == pytest.approx(want.counts("ngram")[0])
    # … and the draft model's (a plain step where the n-gram had no match is the draft
    # model's k = 0 in both: replay once counted it as an empty n-gram block)
    assert got.counts("draft")[1] == pytest.approx(want.counts("draft")[1])
    assert got.counts("draft")[0] == pytest.approx(want.counts("draft")[0])
    for n, (acc, reach) in want.by_proposer["ngram"].by_match.items():
        assert got.by_proposer["ngram"].by_match[n][0] == pytest.approx(acc)
        assert got.by_proposer["ngram"].by_match[n][1] == pytest.approx(reach)


PAIR = PairInfo("synthetic-target", "synthetic-draft", "float32", "cpu: test")
CURVE = {n: 0.1 + 0.004 * (n - 1) for n in range(1, 17)}  # memory-bound: nearly flat
T_D = 0.03


def _record(rng, category: str, draft_alpha: float, copy_share: float, at: float,
            n: int = 96) -> RequestRecord:
    """Greedy traffic served at k = 0: the draft's trace is Bernoulli(draft_alpha); the
    n-gram's has a match at ``copy_share`` of positions, agreeing for 8 tokens there."""
    trace = bytes(1 if rng.random() < draft_alpha else 0 for _ in range(n))
    ngram = bytes(encode_trace_value(3, 8) if rng.random() < copy_share else NGRAM_NONE
                  for _ in range(n))
    return RequestRecord(
        pair=PAIR, category=category, policy="off", greedy=True, prompt_tokens=16,
        new_tokens=n, iterations=n, k_schedule=bytes(n), accepted_schedule=bytes(n),
        wall_s=n * CURVE[1], prefill_s=0.0, draft_s=0.0, draft_forwards=0,
        target_s_by_n={1: [CURVE[1]] * 4}, trace_kind=TRACE_GREEDY, created_at=at,
        path="eager", proposer_schedule=None,
        proposers={**draft(trace=trace),
                   **lookup("ngram", trace=ngram, settings={"max_n": 3, "min_n": 1})})


def copy_and_free_store(path, per_category: int, seed: int):
    """A store at ``path`` of greedy traffic in two categories — "copy" (the output repeats
    the input at 90 % of positions, a weak draft model) and "free" (nothing repeats, a good
    draft model) — and a probe of CURVE and T_D."""
    rng = random.Random(seed)
    store = open_store(f"sqlite:///{path}")
    recs = [_record(rng, "copy", 0.4, 0.9, 1.0e9 + i) for i in range(per_category)]
    recs += [_record(rng, "free", 0.8, 0.0, 1.0e9 + 100 + i) for i in range(per_category)]
    store.write(recs)
    with store.begin() as s:
        add_probe(s, PAIR, {"path": "eager", "draft_s": T_D,
                            "target_s_by_n": {str(n): t for n, t in CURVE.items()}})
    return store


def test_tune_chooses_the_proposer_that_pays_per_category(tmp_path):
    store = copy_and_free_store(tmp_path / "t.db", 40, seed=0)
    results = {r.category: r for r in tune(store, trials=40, families=("fixed",), seed=0,
                                            write=False)}
    copy, free = results["copy"], results["free"]
    assert copy.status == free.status == "tuned"
    assert copy.proposers_searched == ("draft", "ngram", "hybrid")
    # copying traffic: the n-gram proposer (alone or first) drafts nearly everything
    assert copy.proposer in ("ngram", "hybrid") and copy.shares["ngram"] > 0.8
    # nothing repeats: the draft model drafts
    assert free.proposer in ("draft", "hybrid") and (free.shares["ngram"] or 0.0) < 0.05
    store.close()
