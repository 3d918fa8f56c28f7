"""A draft block accepted whole leaves evidence one position further: the draft's next
catch-up predicts the position after it from the target's prefix, which is what a block one
longer would have met there. The live statistics count it at that depth, so a category that
drafts short blocks learns whether longer ones would be accepted (without it, one early
rejection at depth 1 kept a category at k = 1 for good: nothing ever reached depth 1 again)."""

from __future__ import annotations

import random

import pytest
import torch
from test_unproposed import chosen_ks

import autospec
from autospec.policies import CallablePolicy, CostModelPolicy, LiveStats
from autospec.traces import UNOBSERVED
from autospec.tune.replay import Costs, simulate

from conftest import noisy_copy, prompt, tiny

K = 2


def _expected_beyond(st) -> tuple[int, float]:
    """(blocks accepted whole whose next position a later catch-up predicted, the draft's
    matches there), read off the request's schedule and trace."""
    g, reached, accepted = 0, 0, 0
    for i, (k, m) in enumerate(zip(st.k_schedule, st.accepted_schedule)):
        after = g + k
        g += m + 1
        later = i + 1 < len(st.k_schedule) and any(st.k_schedule[i + 1 :])
        if k and m == k and later and st.trace[after] != UNOBSERVED:
            reached += 1
            accepted += st.trace[after]
    return reached, accepted


@pytest.mark.parametrize("seed", [1, 2])
def test_the_loop_counts_the_position_after_a_block_accepted_whole(seed):
    target = tiny("llama", sharpen=30.0, seed=seed)
    spec = autospec.Controller(target, noisy_copy(target, 0.2), store=False,
                               policy=CallablePolicy(lambda ctx: 0 if ctx.generated % 7 == 3
                                                     else K))
    spec.live["x"] = live = LiveStats(discount=1.0)  # undiscounted: exact counts
    spec.generate(prompt(12, seed=seed), max_new_tokens=60, do_sample=False, eos_token_id=None,
                  category="x")
    st = spec.last_stats
    reached, accepted = _expected_beyond(st)
    assert reached >= 3  # the test sees some: blocks accepted whole, then a catch-up
    # no block was longer than K: depth K is the catch-up's evidence alone
    assert max(st.k_schedule) == K
    assert (live.counts("draft")[1][K], live.counts("draft")[0][K]) == (reached, accepted)
    # replaying the request's trace feeds the same evidence
    sim = {"x": LiveStats(discount=1.0)}
    simulate([("greedy", st.trace)], CallablePolicy(lambda ctx: 0 if ctx.generated % 7 == 3
                                                    else K),
             Costs(0.01, {1: 0.1, 3: 0.1}), category="x", live=sim)
    assert (sim["x"].counts("draft")[1][K], sim["x"].counts("draft")[0][K]) == (reached, accepted)


def test_sampled_blocks_accepted_whole_count_the_acceptance_probability_after_them():
    target = tiny("llama", sharpen=10.0, seed=3)
    spec = autospec.Controller(target, noisy_copy(target, 0.2), store=False,
                               policy=CallablePolicy(lambda ctx: K))
    spec.live["x"] = live = LiveStats(discount=1.0)
    torch.manual_seed(0)
    spec.generate(prompt(12, seed=3), max_new_tokens=60, do_sample=True, eos_token_id=None,
                  category="x")
    st = spec.last_stats
    reached, accepted = _expected_beyond(st)
    assert reached >= 3
    assert live.counts("draft")[1][K] == reached
    # the trace holds round(254 β); the statistics β
    assert live.counts("draft")[0][K] == pytest.approx(accepted / 254)
    assert 0 < live.counts("draft")[0][K] < live.counts("draft")[1][K]


def _k_sequence(traces) -> list[int]:
    """The k the cost-model policy chooses per iteration, replaying ``traces`` from a history
    where one block in ten reached depth 1 and few were accepted there."""
    live = LiveStats()
    live.warm_start({"draft": ([95.0, 2.0], [100.0, 10.0])})
    return chosen_ks(traces, live, CostModelPolicy())


def test_a_category_held_at_k1_by_stale_depth_evidence_lengthens_its_blocks(monkeypatch):
    """Traffic the draft matches 95 % of the time, a history that says depth 1 fails: the
    cost model starts at k = 1; the positions after its blocks, accepted whole, show depth 1
    holds, and its blocks grow. With that evidence ignored it stays at k = 1."""
    rng = random.Random(0)
    traces = [("greedy", bytes(1 if rng.random() < 0.95 else 0 for _ in range(64)))
              for _ in range(6)]
    with_beyond = _k_sequence(traces)
    assert with_beyond[0] == 1  # the stale history held it at one token
    longer = next(i for i, k in enumerate(with_beyond) if k > 1)
    assert longer < 80, longer
    grown = with_beyond[longer:]  # and they stay grown
    assert sum(k > 1 for k in grown) > 0.8 * len(grown), with_beyond
    evidence = LiveStats.observe_evidence  # the depth evidence (past depth 0) ignored
    monkeypatch.setattr(LiveStats, "observe_evidence",
                        lambda self, name, depth, value: evidence(self, name, depth, value)
                        if depth == 0 else None)
    without = _k_sequence(traces)
    assert max(without) == 1, without
