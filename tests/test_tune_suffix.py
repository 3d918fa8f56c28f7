"""``autospec tune`` picks suffix decoding for a category where it pays: logged traffic whose
requests repeat earlier ones of their category (the suffix memory holds their whole outputs),
a weak draft model, a memory-bound cost curve. Real tiny models for the live part, a real
SQLite store, real Optuna studies."""

from __future__ import annotations

import re

from test_suffix import _requests

import autospec
from autospec.cli import main
from autospec.store import add_probe, open_store, queries
from autospec.store.queries import TraceRow
from autospec.traces import TRACE_GREEDY
from autospec.tune.replay import Costs
from autospec.tune.study import (
    Window,
    evaluate,
    load_window,
    proposer_sets,
    proposer_space,
    tune,
)

from conftest import noisy_copy, tiny

CURVE = {n: 0.1 + 0.004 * (n - 1) for n in range(1, 18)}  # memory-bound: nearly flat
T_D = 0.03  # the draft model costs 30 % of a target forward per token


def test_the_proposer_space_offers_suffix_sets_where_the_traces_carry_its_trace():
    def row(ngram, suffix):  # a logged request of one position: a trace per proposer
        traces = {"draft": b"\x01"} | ({"ngram": ngram} if ngram else {}) | (
            {"suffix": suffix} if suffix else {})
        return TraceRow(TRACE_GREEDY, traces, b"", b"", new_tokens=1,
                        kinds={n: "model" if n == "draft" else "lookup" for n in traces})

    def space(rows, has_draft=True):
        costs = Costs(t_draft=0.01 if has_draft else 0.0, t_target=CURVE, has_draft=has_draft)
        return proposer_space(Window("c", 1, 0, 0, 0, train=rows), costs)

    assert space([row(b"\x01", None)]) == ("draft", "ngram", "hybrid")
    assert space([row(b"\x01", None), row(b"\x01", b"\x01\x01")]) == (
        "draft", "ngram", "hybrid", "suffix")
    assert space([row(None, b"\x01\x01")]) == ("draft", "suffix")
    assert space([row(b"\x01", b"\x01\x01")], has_draft=False) == ("ngram", "suffix")
    # without the suffix: the cost model's sets are what they were
    assert proposer_sets(("draft", "ngram", "hybrid")) == ["both", "draft", "ngram"]
    assert proposer_sets(("draft", "ngram", "hybrid", "suffix")) == [
        "both", "draft", "ngram", "suffix", "draft+ngram", "draft+suffix", "ngram+suffix"]
    assert proposer_sets(("ngram", "suffix")) == ["both", "ngram", "suffix"]
    assert proposer_sets(("draft",)) == proposer_sets(("ngram",)) == []


def _logged_store(path):
    """A store of greedy traffic served live with the suffix proposer on: category "agent"
    (three prompts, each asked four times in turn: from the second round on, the category's
    memory holds the whole output) with a weak draft model, and a probe of CURVE and T_D."""
    target = tiny("llama", layers=2, seed=5)
    url = f"sqlite:///{path}"
    spec = autospec.Controller(target, noisy_copy(target, 0.6), store=url, suffix=True,
                               policy="fixed:2")
    prompts = _requests(3, seed=9)
    for _ in range(4):
        for ids in prompts:
            spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                          category="agent")
    pair = spec.telemetry.pair
    spec.close()
    store = open_store(url)
    with store.begin() as s:
        add_probe(s, pair, {"path": "eager", "draft_s": T_D,
                            "target_s_by_n": {str(n): t for n, t in CURVE.items()}})
    return store, url


def test_tune_picks_suffix_decoding_where_earlier_requests_repeat(tmp_path, capsys):
    store, url = _logged_store(tmp_path / "t.db")
    with store.session() as s:
        rows = list(queries.traces(s))
    assert len(rows) == 12 and all(r.traces.get("suffix") for r in rows)
    (res,) = tune(store, trials=40, families=("fixed", "costmodel"), seed=0, write=False,
                  min_traces=6)
    assert res.status == "tuned", res.reason
    assert res.proposers_searched == ("draft", "ngram", "hybrid", "suffix")
    # the best policy drafts with the suffix (alone, or in a set that has it: "both" is every
    # proposer the requests have), which drafts a large share of its tokens (the draft model
    # the rest, where the memory has no match yet) ...
    assert "suffix" in res.proposer or res.proposer == "both", (res.family, res.params)
    assert res.shares["suffix"] > 0.25
    # ... and is why it is fast: the same policy on the same traces without suffix decoding
    with store.session() as s:
        window = load_window(s, "agent", res.pair_id, pinned=res.provenance["window"])
    costs = Costs.from_description(res.costs)
    bare = [r._replace(traces={n: t for n, t in r.traces.items() if n != "suffix"})
            for r in window.train]
    without = evaluate(res.family, res.params, bare, costs, k_max=16)
    assert without.proposer("suffix").proposed == 0
    assert res.train_tokens_per_s > 1.3 * without.tokens_per_s
    store.close()
    # the command names it
    assert main(["tune", "--db", url, "--trials", "10", "--families", "fixed,costmodel",
                 "--min-traces", "6", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "searched: draft, ngram, hybrid, suffix" in out
    assert re.search(r"share of drafted tokens in the replay: .*suffix \d+%", out), out
