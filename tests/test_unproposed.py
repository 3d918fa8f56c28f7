"""Positions decoded at k = 0 are evidence too: when drafting resumes, the draft's catch-up
forward predicts them from the target's prefix, and the live statistics count those
predictions at a block's first position, so a category switched off can learn to switch on."""

from __future__ import annotations

import random

import autospec
from autospec.policies import CallablePolicy, CostModelPolicy, LiveStats
from autospec.tune.replay import Costs, simulate

from conftest import noisy_copy, prompt, tiny

N = 40
GAP = 10  # iterations at k = 0 before drafting starts


def schedule(ctx) -> int:
    return 0 if ctx.generated < GAP else 3


def test_the_loop_counts_the_catch_up_predictions_of_k0_positions(arch):
    target = tiny(arch, sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False,
                               policy=CallablePolicy(schedule))
    spec.live["x"] = live = LiveStats(discount=1.0)  # undiscounted: exact counts
    spec.generate(prompt(10, seed=2), max_new_tokens=N, do_sample=False, eos_token_id=None,
                  category="x")
    st = spec.last_stats
    assert st.k_schedule[:GAP] == [0] * GAP and st.k_schedule[GAP] == 3
    blocks = [(k, m) for k, m in zip(st.k_schedule, st.accepted_schedule) if k]
    gap = list(st.trace[:GAP])
    assert all(v in (0, 1) for v in gap)  # the catch-up observed every k = 0 position
    assert live.counts("draft")[1][0] == len(blocks) + GAP
    assert live.counts("draft")[0][0] == sum(1 for _, m in blocks if m) + sum(gap)
    # the simulator replaying the request's trace feeds the same evidence
    sim = {"x": LiveStats(discount=1.0)}
    simulate([("greedy", st.trace)], CallablePolicy(schedule), Costs(0.01, {1: 0.1, 4: 0.1}),
             category="x", live=sim)
    assert (sim["x"].counts("draft")[1][0], sim["x"].counts("draft")[0][0]) == (live.counts("draft")[1][0], live.counts("draft")[0][0])


def test_a_category_switched_off_on_stale_evidence_switches_back_on():
    """History says the draft matches 10 % (200 blocks), so the cost model serves k = 0;
    traffic now matches 85 %. Off is not forever: every plain step discounts the draft's
    counts, and once fewer than ``cold_start`` blocks' worth are left its acceptance counts
    as unmeasured again — its block is explored, the catch-up's predictions of the positions
    decoded at k = 0 count as evidence, and drafting resumes. Undiscounted, it never does."""
    rng = random.Random(0)
    traces = [("greedy", bytes(1 if rng.random() < 0.85 else 0 for _ in range(64)))
              for _ in range(12)]
    ks = _k_sequence(traces, discount=0.995)
    assert ks[0] == 0  # the stale history switched it off
    # ln(200 / 8) / (1 − 0.995) ≈ 642 plain steps of forgetting, then a few blocks
    on = _switched_on_at(ks)
    assert 600 < on < 700, on
    assert sum(k > 0 for k in ks[on:]) >= 0.9 * len(ks[on:])
    never = _k_sequence(traces, discount=1.0)
    assert _switched_on_at(never) == len(never) and not any(never)


def _switched_on_at(ks: list[int], run: int = 8) -> int:
    """The first iteration of ``run`` consecutive drafting ones."""
    for i in range(len(ks) - run + 1):
        if all(k > 0 for k in ks[i : i + run]):
            return i
    return len(ks)


def _k_sequence(traces, discount: float) -> list[int]:
    """The k the cost-model policy chooses per iteration, replaying ``traces`` from a stale
    history (200 blocks at 10 % acceptance) with the statistics' ``discount``."""
    live = LiveStats(discount=discount)
    live.warm_start({"draft": ([20.0], [200.0])})
    return chosen_ks(traces, live, CostModelPolicy())


def chosen_ks(traces, live: LiveStats, policy) -> list[int]:
    """The k ``policy`` chooses per iteration, replaying ``traces`` as category "c" from
    ``live`` and costs warmed with the replay's own (T_d 0.03 s; T_t 0.1 s, 0.11 s at 8)."""
    costs = Costs(0.03, {1: 0.1, 2: 0.1, 8: 0.11})
    table = costs.table()
    table.at(costs.path).warm(t_target=costs.t_target, t_draft=costs.t_draft)
    chosen: list[int] = []

    class Recording:
        name = "recording"

        def choose(self, ctx):
            chosen.append(policy.choose(ctx))
            return chosen[-1]

        def update(self, ctx, k, outcome):
            policy.update(ctx, k, outcome)

    simulate(traces, Recording(), costs, k_max=8, category="c", live={"c": live},
             table=table)
    return chosen
