"""Replay of logged traces makes the live run's decisions and keeps its counters.

The live engine and trace replay share the context (``decide.make_context``), the choice
(``decide.decide``) and the accounting (``accounting.account``). A policy that decides from
everything the accounting feeds — the category's draft-model and prompt-lookup statistics,
the request's own, the draft's gap, the lookup's match — runs live on a real store, then on
the traces that store kept: every request gets the same schedule (k, accepted, proposer per
iteration), the same counters per proposer, and the category's statistics end up the same.
At batch 1 and at batch 3 (rows of different lengths, one left-padded).
"""

from __future__ import annotations

import pytest
import torch
from test_ngram import _repetitive, _repetitive_batch

import autospec
from autospec.policies import Choice, LiveStats
from autospec.store import open_store, queries
from autospec.tune.replay import Costs, simulate

from conftest import noisy_copy, tiny

GRID = {b: {n: 0.1 + 0.01 * n for n in range(1, 18)} for b in (1, 2, 3)}
COSTS = Costs(t_draft=0.01, t_target=GRID[1], target_grid=GRID,
              draft_grid={b: 0.01 for b in GRID})


class Reader:
    """Decides from the statistics alone (never from timings, which replay prices instead of
    measuring): prompt lookup where its match is long and it has paid, the draft model at a
    k that follows its acceptance so far, and a plain stretch now and then (which the draft
    then catches up on)."""

    name = "reader"

    def choose(self, ctx):
        live, request = ctx.live, ctx.request
        if request.iterations % 6 == 5:
            return 0  # a plain step: the draft's next block starts with a catch-up
        ngram = live.first_acceptance("ngram")
        if ctx.matches["ngram"][0] >= 2 and (ngram is None or ngram > 0.3):
            return Choice(4, "hybrid", 2)
        accepted, reached = (c[0] for c in live.counts("draft"))
        alpha = accepted / reached if reached else 0.5
        if ctx.gap > 12 and alpha < 0.3:
            return 0
        unmatched, matched = request.by_proposer["ngram"].match_points
        return 1 + round(4 * alpha) + (matched > unmatched)

    def update(self, ctx, k, outcome):
        pass


def _schedules(st):
    return (st.k_schedule, st.accepted_schedule, st.proposer_schedule,
            st.drafted, st.accepted, st.drafted_per_position, st.accepted_per_position,
            st.proposer("ngram").proposed, st.proposer("ngram").accepted,
            st.proposer("ngram").proposed_per_position)


def _same_counts(live: LiveStats, replayed: LiveStats) -> None:
    """Every proposer's counts equal, by name: pooled, by match length, match points."""
    assert sorted(live.by_proposer) == sorted(replayed.by_proposer)
    for name, got in live.by_proposer.items():
        want = replayed.by_proposer[name]
        assert got.accepted == pytest.approx(want.accepted), name
        assert got.reached == pytest.approx(want.reached), name
        assert got.match_points == pytest.approx(want.match_points), name
        assert sorted(got.by_match) == sorted(want.by_match), name
        for n, (acc, reach) in want.by_match.items():
            assert got.by_match[n][0] == pytest.approx(acc)
            assert got.by_match[n][1] == pytest.approx(reach)
        assert got.blocks == want.blocks, name


@pytest.mark.parametrize("rows", [1, 3])
def test_replay_makes_the_live_runs_decisions_and_counts(tmp_path, rows):
    target = tiny("llama", layers=2, seed=5)
    url = f"sqlite:///{tmp_path / 'live.db'}"
    spec = autospec.Controller(target, noisy_copy(target, 0.1), store=url, policy=Reader())
    served = []
    for seed in range(3):
        if rows == 1:
            ids = _repetitive(seed)
            mask = torch.ones_like(ids)
        else:
            ids, mask = _repetitive_batch([6, 9, 4], seed=seed)
        spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                      pad_token_id=0, eos_token_id=None, category="copy")
        served += spec.last_row_stats
    live = spec.live["copy"]
    spec.close()
    with open_store(url) as store, store.session() as s:
        logged = list(queries.traces(s))
    assert len(logged) == 3 * rows and all(r.traces.get("ngram") for r in logged)
    lives = {}
    res = simulate(logged, Reader(), COSTS, live=lives, category="copy")
    assert [_schedules(st) for st in res.requests] == [_schedules(st) for st in served]
    # every kind of iteration happened: draft blocks, lookup blocks, plain steps
    kinds = {(k > 0, p) for st in served for k, p in zip(st.k_schedule, st.proposer_schedule)}
    assert kinds == {(True, "draft"), (True, "ngram"), (False, None)}
    assert res.unobserved_hits == 0
    _same_counts(live, lives["copy"])
