"""Replay runs the batches as they ran. The rows of one batched call are logged with the call's
id and replay together — their categories may differ, each row feeding its own category's
statistics — and a block the logged run also ran takes its logged outcome, so the policy that
ran replays its own run exactly, sampled as well as greedy: at batch 1, 3 and 8, rows of two
categories in every batch, every request's schedule and counters per proposer and every
category's statistics the same as live."""

from __future__ import annotations

import pytest
import torch
from test_ngram import _repetitive_batch

import autospec
from autospec.policies import Choice
from autospec.store import open_store, queries
from autospec.tune.replay import simulate

from conftest import noisy_copy, tiny
from test_replay_equals_live import COSTS, _same_counts

CATEGORIES = ("copy", "chat")
GRID = {b: {n: 0.1 + 0.01 * n for n in range(1, 18)} for b in range(1, 9)}
COSTS8 = type(COSTS)(t_draft=0.01, t_target=GRID[1], target_grid=GRID,
                     draft_grid={b: 0.01 for b in GRID})


class PerCategory:
    """Decides from what the accounting feeds (never timings): per category a different rule
    (prompt lookup where it matches and has paid in "copy"; the draft model at a k that follows
    the category's acceptance in both), and a plain step now and then."""

    name = "per-category"

    def choose(self, ctx):
        live, request = ctx.live, ctx.request
        if request.iterations % 5 == 3:
            return 0
        accepted, reached = (c[0] for c in live.counts("draft"))
        alpha = accepted / reached if reached else 0.5
        if ctx.category == "copy":
            ngram = live.first_acceptance("ngram")
            if ctx.matches["ngram"][0] >= 2 and (ngram is None or ngram > 0.3):
                return Choice(3, "hybrid", 2)
            return 1 + round(3 * alpha)
        return 2 + round(2 * alpha)

    def update(self, ctx, k, outcome):
        pass


def _schedules(st):
    return (st.k_schedule, st.accepted_schedule, st.proposer_schedule, st.batch_size,
            {n: (c.blocks, c.proposed, c.accepted, c.proposed_per_position,
                 c.accepted_per_position) for n, c in st.counts.items() if c.blocks})


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_policy_that_ran_replays_its_own_run(tmp_path, rows, sampled):
    target = tiny("llama", layers=2, seed=5)
    url = f"sqlite:///{tmp_path / 'live.db'}"
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=url,
                               policy=PerCategory())
    kw = dict(do_sample=True, top_k=0, temperature=1.3) if sampled else dict(do_sample=False)
    g = torch.Generator().manual_seed(3)
    served = []
    for call in range(2 if rows > 1 else 4):
        lengths = [4 + (3 * i + call) % 7 for i in range(rows)]
        ids, mask = _repetitive_batch(lengths, seed=call)
        cats = [CATEGORIES[(i + call) % 2] for i in range(rows)]
        spec.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0,
                      eos_token_id=None, category=cats if rows > 1 else cats[0],
                      generator=g if sampled else None, **kw)
        served += spec.last_row_stats
    lives = {c: spec.live[c] for c in CATEGORIES}
    spec.close()
    with open_store(url) as store, store.session() as s:
        logged = list(queries.traces(s))
    assert len(logged) == len(served)
    if rows > 1:  # each call's rows under one id, mixing the categories
        calls = {r.batch_id for r in logged}
        assert len(calls) == 2 and None not in calls
        assert all(len({r.category for r in logged if r.batch_id == c}) == 2 for c in calls)
    replayed = {}
    res = simulate(logged, PerCategory(), COSTS8, live=replayed,
                   category=lambda row: row.category)
    assert [_schedules(st) for st in res.requests] == [_schedules(st) for st in served]
    kinds = {p for st in served for p in st.proposer_schedule}
    assert {"draft", None} <= kinds
    for c in CATEGORIES:
        _same_counts(lives[c], replayed[c])


def test_rows_logged_without_a_call_id_replay_grouped_by_size_and_category(tmp_path):
    """A store written before 0011 has no call ids: its batched rows replay B at a time per
    (B, category), as before."""
    target = tiny("llama", layers=2, seed=5)
    url = f"sqlite:///{tmp_path / 'old.db'}"
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=url, policy="fixed:2")
    ids, mask = _repetitive_batch([5, 7, 6], seed=1)
    spec.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0,
                  eos_token_id=None, do_sample=False, category=["copy", "chat", "copy"])
    spec.close()
    with open_store(url) as store, store.session() as s:
        logged = [r._replace(batch_id=None) for r in queries.traces(s)]
    res = simulate(logged, autospec.policies.as_policy("fixed:2"), COSTS8,
                   category=lambda row: row.category)
    # "copy" replays as one batch of two rows, "chat" alone
    assert sorted(st.batch_size for st in res.requests) == [1, 2, 2]


class ByRoom:
    """Reads the room a row has left (``Context.remaining``) at every iteration: k shrinks as
    the limit nears."""

    name = "by-room"

    def choose(self, ctx):
        return max(1, min(5, ctx.remaining // 6))

    def update(self, ctx, k, outcome):
        pass


@pytest.mark.parametrize("rows", [1, 3])
def test_requests_an_eos_ended_replay_with_the_room_they_had(tmp_path, rows):
    """A request an EOS ended before its limit: the live policy saw the room to its limit at
    every iteration, and its last block was cut by that room, not by the EOS it could not
    know. The store keeps the limit (0012), so replay shows the policy the same room."""
    target = tiny("llama", layers=2, seed=5)
    draft = noisy_copy(target, 0.3)
    url = f"sqlite:///{tmp_path / 'eos.db'}"
    spec = autospec.Controller(target, draft, store=url, policy=ByRoom())
    served = []
    for call in range(2):
        ids, mask = _repetitive_batch([5 + call + 2 * i for i in range(rows)], seed=call)
        free = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
        eos = [int(free[0, 9 + call]), int(free[-1, 17])]  # rows end early, at different points
        spec.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0,
                      eos_token_id=eos, do_sample=False, category="chat")
        served += spec.last_row_stats
    spec.close()
    assert sum(st.stop_reason == "eos" for st in served) >= 2
    with open_store(url) as store, store.session() as s:
        logged = list(queries.traces(s))
    assert [r.max_new_tokens for r in logged] == [30] * len(served)
    assert any(r.new_tokens < 30 for r in logged)
    res = simulate(logged, ByRoom(), COSTS8, category=lambda row: row.category)
    assert [_schedules(st) for st in res.requests] == [_schedules(st) for st in served]
    # without the limit (a store from before 0012) the room shown is the length left
    old = simulate([r._replace(max_new_tokens=None) for r in logged], ByRoom(), COSTS8,
                   category=lambda row: row.category)
    assert [_schedules(st) for st in old.requests] != [_schedules(st) for st in served]
