"""T_d is the cost of one proposal: the draft's catch-up after a k = 0 stretch (and the trace
read from it) is a cost of resuming and must not be charged per proposed token. Charged, it
made the draft look several times dearer right after every stretch at k = 0, and the cost
model kept speculation off on traffic where it paid (issue: batch 1, cold store).

The catch-up's trace reading is slowed down on purpose (a sleep far above a tiny model's
forward): the attribution, not the speed, is under test."""

from __future__ import annotations

import time

import pytest

import autospec
from autospec.engine.proposers.draft_model import DraftModel
from autospec.policies.base import Outcome

from conftest import noisy_copy, prompt, tiny
from test_batch_exact import batch

SLOW = 0.3  # seconds added to every reading of a catch-up's trace: far above a tiny
# draft step even on a loaded machine (at 0.05 s a busy CI core made one step look slow)


class Stretches:
    """k = 0 for ``off`` iterations, then ``k`` for ``on``, repeated; records outcomes."""

    name = "stretches"

    def __init__(self, k=3, off=6, on=2):
        self.k, self.off, self.on = k, off, on
        self.i = 0
        self.log: list[tuple[int, int, Outcome]] = []  # (previous k, k, outcome)
        self.prev = None

    def choose(self, ctx) -> int:
        phase = self.i % (self.off + self.on)
        self.i += 1
        return 0 if phase < self.off else self.k

    def update(self, ctx, k, outcome) -> None:
        self.log.append((self.prev, k, outcome))
        self.prev = k


@pytest.fixture
def slow_catch_up(monkeypatch):
    orig = DraftModel._catch_up_trace

    def slow(self, *a, **kw):
        time.sleep(SLOW)
        return orig(self, *a, **kw)

    monkeypatch.setattr(DraftModel, "_catch_up_trace", slow)


def _resumed(log):
    return [o for prev, k, o in log if prev == 0 and k > 0]


def test_catch_up_after_k0_is_not_charged_to_the_draft_at_batch_1(slow_catch_up):
    target = tiny("llama", sharpen=30.0)
    draft = noisy_copy(target, 0.5)
    policy = Stretches()
    spec = autospec.Controller(target, draft, store=False, policy=policy)
    spec.generate(prompt(10), max_new_tokens=40, do_sample=False, eos_token_id=None)
    resumed = _resumed(policy.log)
    assert len(resumed) >= 3
    # the slowed trace reading after each stretch went to the catch-up, not to T_d
    assert all(o.draft_time_s < SLOW for o in resumed), [o.draft_time_s for o in resumed]
    assert spec.last_stats.draft_prefill_s >= SLOW * len(resumed)


def test_catch_up_after_k0_is_not_charged_to_the_draft_at_batch(slow_catch_up):
    target = tiny("llama", sharpen=30.0)
    draft = noisy_copy(target, 0.5)
    policy = Stretches()
    spec = autospec.Controller(target, draft, store=False, policy=policy)
    ids, mask = batch([6, 9, 7], seed=4)
    spec.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                  eos_token_id=None)
    resumed = _resumed(policy.log)
    assert len(resumed) >= 2
    assert all(o.draft_time_s < SLOW for o in resumed), [o.draft_time_s for o in resumed]
