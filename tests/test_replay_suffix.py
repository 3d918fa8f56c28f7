"""Replay of logged traces makes the live run's decisions with suffix decoding on, and keeps its
counters (as ``test_replay_equals_live`` does for the draft model and prompt lookup).

Requests of one category run in order at batch 1 (and in calls of 3 rows) on a real SQLite
store, with the suffix proposer beside the draft model and prompt lookup: its memory of the
category's earlier outputs grows request by request (a later request repeats the first
prompt, so the memory holds its whole output). Each request's suffix trace was computed from
the memory as that request saw it (at 3 rows, as the call started); replaying the stored
traces gives every request the same schedule (k, accepted, proposer per iteration) and
counters per proposer, and the category's statistics — the suffix's own, per match length,
from its blocks and its shadow — end up the same.

The policies: a fixed ``"suffix:4"``; one that decides from the statistics alone (never from
timings, which replay prices instead of measuring); and ``"auto"`` over category statistics
whose timings are pinned (its costs are read, never measured: live timings are the machine's,
replay's are the cost model's, and no policy that reads them can agree between the two).
"""

from __future__ import annotations

import pytest
import torch
from test_suffix import _requests

import autospec
from autospec.costs.table import CostTable
from autospec.policies import Choice, LiveStats, as_policy
from autospec.store import open_store, queries
from autospec.tune.replay import Costs, simulate

from conftest import noisy_copy, tiny
from test_replay_equals_live import _same_counts

NAN = float("nan")
GRID = {n: 0.1 + 0.01 * n for n in range(1, 18)}
COSTS = Costs(t_draft=0.01, t_target=GRID, t_lookup={"ngram": 1e-5, "suffix": 1e-5},
              target_grid={b: GRID for b in (2, 3)}, draft_grid={b: 0.01 for b in (2, 3)})


class Reader:
    """Decides from the statistics alone: suffix decoding where its match is long and it has
    paid, as long a block as its draft holds; prompt lookup on a long match; else the draft
    model at a k that follows its acceptance so far; a plain step now and then."""

    name = "suffix-reader"

    def choose(self, ctx):
        live, request = ctx.live, ctx.request
        if request.iterations % 7 == 6:
            return 0  # a plain step: the draft's next block starts with a catch-up
        suffix = live.first_acceptance("suffix")
        if ctx.matches["suffix"][0] >= 2 and (suffix is None or suffix > 0.4):
            return Choice(min(8, ctx.sizes["suffix"][0]), "suffix")
        if ctx.matches["ngram"][0] >= 3:
            return Choice(3, "ngram")
        accepted, reached = (c[0] for c in live.counts("draft"))
        alpha = accepted / reached if reached else 0.5
        return 1 + round(3 * alpha)

    def update(self, ctx, k, outcome):
        pass


class Pinned(LiveStats):
    """A category's statistics that take no time into their rate: the counts are learned as
    usual, every timing handed in is dropped."""

    def observe(self, k, accepted, draft_s, target_s, **kwargs):
        super().observe(k, accepted, NAN, NAN, **kwargs)

    def observe_lookup(self, proposer, k, accepted, lookup_s, target_s, **kwargs):
        super().observe_lookup(proposer, k, accepted, NAN, NAN, **kwargs)

    def observe_catch_up(self, tokens, seconds):
        pass


class PinnedCosts(CostTable):
    """A cost table whose batch-1 costs (on every path asked for) are COSTS', set once and
    never measured: every timing handed in is dropped."""

    def at(self, path, batch=1, context=0):
        row = super().at(path, batch, context)
        if not row.t_target:
            row.t_target = dict(GRID)
            row.t_draft, row.t_lookup = COSTS.t_draft, {"ngram": 1e-5, "suffix": 1e-5}
            row.observe = lambda *args, **kwargs: None
            row.observe_catch_up = lambda *args, **kwargs: None
        return row


def _schedules(st):
    return (st.k_schedule, st.accepted_schedule, st.proposer_schedule,
            st.drafted, st.accepted, st.drafted_per_position, st.accepted_per_position,
            st.proposer("ngram").proposed, st.proposer("ngram").accepted,
            st.proposer("suffix").blocks, st.proposer("suffix").proposed,
            st.proposer("suffix").accepted, st.proposer("suffix").proposed_per_position,
            st.proposer("suffix").accepted_per_position)


def _policy(name):
    return Reader() if name == "reader" else as_policy(name)


@pytest.mark.parametrize("name, rows", [("suffix:4", 1), ("reader", 1), ("auto", 1),
                                        ("suffix:4", 3), ("reader", 3)])
def test_replay_makes_the_live_runs_decisions_with_suffix_decoding(tmp_path, name, rows):
    target = tiny("llama", layers=2, seed=5)
    url = f"sqlite:///{tmp_path / 'live.db'}"
    spec = autospec.Controller(target, noisy_copy(target, 0.1), store=url, suffix=True,
                               policy=_policy(name))
    pinned = name == "auto"
    if pinned:
        spec.live["sql"], spec.costs = Pinned(), PinnedCosts()
    served = []
    prompts = _requests(4, seed=6) + _requests(1, seed=6)  # the last repeats the first
    if rows > 1:  # calls of 3 rows: the repeat among the second call's
        prompts = [torch.cat(prompts[:3]), torch.cat([*prompts[3:], _requests(1, seed=7)[0]])]
    for ids in prompts:
        spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                      do_sample=False, eos_token_id=None, category="sql")
        served += spec.last_row_stats
    live = spec.live["sql"]
    spec.close()
    with open_store(url) as store, store.session() as s:
        logged = list(queries.traces(s))
    assert len(logged) == len(served) and all(r.traces.get("suffix") and r.traces.get("ngram")
                                            for r in logged)
    lives = {"sql": Pinned()} if pinned else {}
    res = simulate(logged, _policy(name), COSTS, live=lives, category="sql", k_max=16,
                   table=PinnedCosts(live=False) if pinned else None)
    assert [_schedules(st) for st in res.requests] == [_schedules(st) for st in served]
    assert res.unobserved_hits == 0
    _same_counts(live, lives["sql"])
    # the suffix drafted, most of all on the repeat (its whole output is in the memory)
    codes = [set(st.proposer_schedule) for st in served]
    assert "suffix" in codes[-1 if rows == 1 else -2]
    repeat = served[-1 if rows == 1 else -2]
    assert repeat.proposer("suffix").accepted >= 0.9 * repeat.proposer("suffix").proposed > 0
    assert res.proposer("suffix").proposed == sum(st.proposer("suffix").proposed for st in served)
    assert res.proposer("suffix").accepted == sum(st.proposer("suffix").accepted for st in served)
    if name == "reader":  # every kind of iteration happened
        kinds = {(k > 0, p) for st in served
                 for k, p in zip(st.k_schedule, st.proposer_schedule)}
        assert {(True, "draft"), (True, "suffix"), (False, None)} <= kinds
