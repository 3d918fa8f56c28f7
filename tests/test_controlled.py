"""Controlled-acceptance pairs (autospec.testing.controlled): the greedy acceptance read back from the
loop's traces is the α asked for, output is still the target's own greedy output, and the
construction keeps every layer in the computation."""

from __future__ import annotations

import pytest
import torch

from autospec.testing.controlled import controlled_pair, measure_acceptance, qwen2_config

TOLERANCE = 0.08  # |measured − constructed α| over ~250 positions (std ≈ 0.03 at α = 0.5)


def _pair(alpha, seed=0):
    return controlled_pair(qwen2_config("tiny"), qwen2_config("tiny", num_hidden_layers=1),
                           alpha, seed=seed)


@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.9])
def test_measured_acceptance_is_the_constructed_alpha(alpha):
    target, draft, info = _pair(alpha)
    assert abs(info["exact_alpha"] - alpha) < 1 / 97 + 1e-9
    acc = measure_acceptance(target, draft, prompts=4, max_new_tokens=64, k=4,
                             check_generate=True)
    assert acc.positions >= 200
    assert abs(acc.alpha - info["exact_alpha"]) <= TOLERANCE, acc
    assert acc.outputs_equal


def test_acceptance_does_not_depend_on_k_and_holds_on_the_static_path():
    target, draft, _ = _pair(0.8, seed=3)
    runs = [measure_acceptance(target, draft, prompts=2, max_new_tokens=48, k=k, seed=1,
                               **opts)
            for k, opts in ((1, {}), (6, {}), (3, dict(static_cache=True, cuda_graphs="emulate")))]
    assert len({r.alpha for r in runs}) == 1  # greedy traces are k-independent, exactly
    assert runs[1].mean_accepted_length > runs[0].mean_accepted_length


def test_extremes_accept_everything_or_nothing():
    assert measure_acceptance(*_pair(1.0)[:2], prompts=2, max_new_tokens=32).alpha == 1.0
    assert measure_acceptance(*_pair(0.0)[:2], prompts=2, max_new_tokens=32).alpha == 0.0


def test_every_layer_still_computes():
    # the residual branches are scaled down, not removed: every layer changes the output a
    # little, so none can be skipped as dead code
    target, _, _ = _pair(0.8)
    ids = torch.tensor([[5, 9, 13, 40]])
    with torch.no_grad():
        full = target(ids).logits
        for p in target.model.layers[-1].mlp.down_proj.parameters():
            p.zero_()
        cut = target(ids).logits
    assert 0 < (full - cut).abs().max() < 1.0
    assert torch.equal(full.argmax(-1), cut.argmax(-1))


def test_the_pair_can_share_one_target_across_drafts():
    target, d1, _ = _pair(0.5)
    same, d2, info = controlled_pair(qwen2_config("tiny"), qwen2_config("tiny", num_hidden_layers=1),
                                     0.9, target=target)
    assert same is target
    acc = measure_acceptance(target, d2, prompts=3, max_new_tokens=64)
    assert abs(acc.alpha - info["exact_alpha"]) <= TOLERANCE
