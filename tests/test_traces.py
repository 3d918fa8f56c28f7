"""Acceptance traces recorded live replay to the accepted lengths other k values see."""

from __future__ import annotations

import random

import pytest
import torch

import autospec
from autospec.store.record import UNOBSERVED
from autospec.tune.replay import replay_greedy

from conftest import noisy_copy, prompt, tiny


@pytest.fixture
def spec(arch):
    target = tiny(arch, sharpen=30.0)
    return autospec.Controller(target, noisy_copy(target, 0.15))


@pytest.mark.parametrize("recorded_k", [1, 4, 7])
def test_greedy_trace_replays_exactly_under_other_k(spec, recorded_k):
    checked = 0
    for seed in range(3):
        ids = prompt(10, seed=seed)
        spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, k=recorded_k)
        trace = spec.last_stats.trace
        assert len(trace) == 40
        # every position is observed but the tail: a final bonus token, and the last token when
        # max_new_tokens leaves no room to draft for it
        assert UNOBSERVED not in trace[:-2]
        for k in (1, 2, 3, 5, 8):
            spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, k=k)
            live = spec.last_stats.accepted_schedule
            replayed = replay_greedy(trace, k, max_new_tokens=40)
            assert replayed == live[: len(replayed)], (recorded_k, k, seed)
            assert len(replayed) >= len(live) - 2  # only the final blocks may be unknown
            checked += 1
    assert checked == 15


def test_positions_decoded_at_k0_are_filled_when_the_draft_catches_up(spec):
    rng = random.Random(1)
    spec.policy = autospec.policies.CallablePolicy(lambda ctx: rng.choice([0, 0, 0, 3]))
    ids = prompt(10, seed=4)
    spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    trace = spec.last_stats.trace
    assert 0 in spec.last_stats.k_schedule
    ks = spec.last_stats.k_schedule
    # positions after the last drafting iteration stay unobserved; everything before is known
    last_draft_pos = sum(a + 1 for a in spec.last_stats.accepted_schedule[: max(
        i for i, k in enumerate(ks) if k > 0)])
    assert UNOBSERVED not in trace[:last_draft_pos]
    spec.policy = autospec.policies.FixedK(4)
    spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    full = spec.last_stats.trace
    assert trace[:last_draft_pos] == full[:last_draft_pos]


def test_sampled_trace_holds_acceptance_probabilities(arch):
    target = tiny(arch, sharpen=30.0)
    spec = autospec.Controller(target, target)  # q == p: β = 1 everywhere observed
    spec.generate(prompt(8), max_new_tokens=30, do_sample=True, eos_token_id=None, k=3,
                  generator=torch.Generator().manual_seed(0))
    observed = [b for b in spec.last_stats.trace if b != UNOBSERVED]
    assert len(observed) >= 25 and set(observed) == {254}
    assert spec.last_stats.trace_kind == "sampled"

    draft = noisy_copy(target, 0.5)
    spec = autospec.Controller(target, draft)
    betas, accepts = [], []
    g = torch.Generator().manual_seed(1)
    for seed in range(20):
        spec.generate(prompt(8, seed=seed), max_new_tokens=20, do_sample=True,
                      eos_token_id=None, k=1, generator=g)
        st = spec.last_stats
        pos = 0
        for k, m in zip(st.k_schedule, st.accepted_schedule):
            if k and st.trace[pos] != UNOBSERVED:
                betas.append(st.trace[pos] / 254)
                accepts.append(m)
            pos += m + 1
    # with k = 1 the acceptance of each block is a Bernoulli(β) draw: the means agree
    mean_beta, mean_acc = sum(betas) / len(betas), sum(accepts) / len(accepts)
    assert 0.05 < mean_beta < 0.95
    assert abs(mean_beta - mean_acc) < 4 * (mean_beta * (1 - mean_beta) / len(betas)) ** 0.5
