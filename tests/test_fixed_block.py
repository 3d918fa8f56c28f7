"""The draft model's acceptance in a block of fixed k without early stop, from its greedy
traces (``store.history.fixed_block_acceptance``): what an engine's fixed
``num_speculative_tokens`` accepts. Hand-made traces with the answer counted by hand, and a
constant-rate trace whose every position must come out at that rate."""

from __future__ import annotations

import random

import pytest

from autospec.store.history import fixed_block_acceptance
from autospec.store.queries import TraceRow
from autospec.traces import UNOBSERVED

U = UNOBSERVED


def row(trace, kind: str = "greedy", batch: int = 1) -> TraceRow:
    return TraceRow(kind, {"draft": bytes(trace)}, b"", b"", batch_size=batch,
                    new_tokens=len(trace), kinds={"draft": "model"})


def test_runs_counted_by_hand():
    # a block from each position accepts the agreeing run there: 2, 1, 0, 1, 0 (each ended by
    # an observed miss) — token 1: 3 of 5; token 2: 1 of 3 (from 0, 1, 3); token 3: 0 of 1
    got = fixed_block_acceptance([row([1, 1, 0, 1, 0])], k_max=4)
    assert got == [pytest.approx(3 / 5), pytest.approx(1 / 3), 0.0, None]


def test_a_run_cut_by_the_end_or_an_unobserved_position_counts_as_far_as_seen():
    # runs of 2 and 1 reaching the end: tokens 1 and 2 agree, what follows is not known
    assert fixed_block_acceptance([row([1, 1])], k_max=3) == [1.0, 1.0, None]
    # from 0: one agreeing token, then nothing observed; from 2: a miss
    assert fixed_block_acceptance([row([1, U, 0])], k_max=2) == [0.5, None]
    # nothing observed: nothing said
    assert fixed_block_acceptance([row([U, U])], k_max=2) == [None, None]


def test_only_greedy_batch_one_rows_are_read():
    rows = [row([0, 0, 0]), row([1, 1, 1], kind="sampled"), row([1, 1, 1], batch=2)]
    assert fixed_block_acceptance(rows, k_max=2) == [0.0, None]
    # the latest ``limit`` rows only
    assert fixed_block_acceptance([row([0, 0]), row([1, 1])], k_max=1, limit=1) == [1.0]


@pytest.mark.parametrize("alpha", [0.3, 0.7, 0.9])
def test_a_constant_rate_comes_out_at_every_position(alpha):
    """Agreement Bernoulli(α) per position: a fixed-k block accepts token i with probability
    α given the ones before it, at every i (where enough runs reach it)."""
    rng = random.Random(3)
    rows = [row([1 if rng.random() < alpha else 0 for _ in range(1000)]) for _ in range(40)]
    got = fixed_block_acceptance(rows, k_max=4)
    assert all(a is not None and abs(a - alpha) < 0.05 for a in got), got
