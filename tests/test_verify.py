"""The rejection rule: exact distribution, edge cases, determinism.

Statistical tests use seeded generators, so each run is deterministic; the stated
significance level is the false-alarm rate over seeds. A companion test shows the same
statistic does reject a wrong distribution, so the check has power.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from autospec import greedy_verify, rejection_sample

ALPHA = 1e-3  # false-alarm rate of each chi-square test


def _dist(logits):
    return torch.softmax(torch.tensor(logits, dtype=torch.float64), -1).float()


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs.double() * n
    keep = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] < 5:
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


def _first_token(p, q, n, seed):
    """Run the rule on n independent rows with draft tokens sampled from q; return the first
    emitted token of each (the first draft token if accepted, else the recovered one)."""
    k, V = q.shape
    g = torch.Generator().manual_seed(seed)
    draft_tokens = torch.multinomial(q.expand(n, k, V).reshape(-1, V), 1, generator=g).view(n, k)
    num_acc, nxt = rejection_sample(p.expand(n, k + 1, V), q.expand(n, k, V), draft_tokens,
                                    generator=g)
    return torch.where(num_acc > 0, draft_tokens[:, 0], nxt), num_acc, nxt, draft_tokens


P = torch.stack([_dist([2.0, 1.0, 0.0, -1.0, 0.5, 1.5]), _dist([0.0, 0.0, 3.0, 0.0, 0.0, 0.0]),
                 _dist([1.0, 1.0, 1.0, 1.0, 1.0, -2.0])])  # [k+1=3, V=6]
Q = torch.stack([_dist([0.0, 2.0, 1.0, 0.0, -1.0, 0.0]), _dist([0.0, 1.0, 1.0, 1.0, 0.0, 0.0])])


def test_emitted_token_follows_the_target_distribution():
    first, *_ = _first_token(P, Q, 40_000, seed=1)
    counts = torch.bincount(first, minlength=6)
    assert _chi2_pvalue(counts, P[0]) > ALPHA


def test_the_statistic_rejects_the_draft_distribution():
    # power: the same test on the same samples against q must fail
    first, *_ = _first_token(P, Q, 40_000, seed=1)
    assert _chi2_pvalue(torch.bincount(first, minlength=6), Q[0]) < ALPHA


def test_total_variation_shrinks_with_sample_size():
    tvs = []
    for n in (1_000, 10_000, 100_000):
        first, *_ = _first_token(P, Q, n, seed=2)
        freq = torch.bincount(first, minlength=6).float() / n
        tvs.append(0.5 * (freq - P[0]).abs().sum().item())
    assert tvs[2] < tvs[0] and tvs[2] < 0.01


def test_acceptance_rate_is_sum_of_min_p_q():
    _, num_acc, *_ = _first_token(P, Q, 40_000, seed=3)
    beta = torch.minimum(P[0], Q[0]).sum().item()
    assert abs((num_acc > 0).float().mean().item() - beta) < 0.01


def test_bonus_token_comes_from_the_last_target_position():
    # q == p: every draft token is accepted, so the next token is the bonus one ~ p_{k+1}
    n = 30_000
    first, num_acc, nxt, _ = _first_token(P, P[:2], n, seed=4)
    assert bool((num_acc == 2).all())
    assert _chi2_pvalue(torch.bincount(nxt, minlength=6), P[2]) > ALPHA


def test_all_accepted_with_one_hot_agreement():
    p = torch.eye(5)[[1, 2, 3]][None]  # target argmax 1, 2, then bonus 3
    q = torch.eye(5)[[1, 2]][None]
    num_acc, nxt = rejection_sample(p, q, torch.tensor([[1, 2]]))
    assert num_acc.tolist() == [2] and nxt.tolist() == [3]


def test_first_token_rejected_recovers_from_the_residual():
    p = torch.eye(5)[[4, 2, 3]][None]
    q = torch.eye(5)[[1, 2]][None]
    num_acc, nxt = rejection_sample(p, q, torch.tensor([[1, 2]]))
    assert num_acc.tolist() == [0] and nxt.tolist() == [4]


def test_token_with_zero_target_probability_is_never_accepted():
    p = _dist([0.0, 0.0, 0.0, 0.0])[None, None].repeat(1, 2, 1)
    p[0, 0, 2] = 0
    p[0, 0] /= p[0, 0].sum()
    q = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]])
    num_acc, nxt = rejection_sample(p.expand(500, 2, 4), q.expand(500, 1, 4),
                                    torch.full((500, 1), 2), generator=torch.Generator())
    assert bool((num_acc == 0).all()) and bool((nxt != 2).all())


def test_k_zero_samples_from_the_target():
    p = P[:1][None]
    num_acc, nxt = rejection_sample(p.expand(20_000, 1, 6), torch.empty(20_000, 0, 6),
                                    torch.empty(20_000, 0, dtype=torch.long),
                                    generator=torch.Generator().manual_seed(5))
    assert bool((num_acc == 0).all())
    assert _chi2_pvalue(torch.bincount(nxt, minlength=6), P[0]) > ALPHA


def test_seeded_generator_is_deterministic():
    a = _first_token(P, Q, 1000, seed=7)
    b = _first_token(P, Q, 1000, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_greedy_verify_equals_rejection_sample_on_one_hot():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        k, V = 4, 7
        tgt = torch.randint(0, 3, (8, k + 1), generator=g)  # small range → many matches
        drf = torch.randint(0, 3, (8, k), generator=g)
        p = torch.nn.functional.one_hot(tgt, V).float()
        q = torch.nn.functional.one_hot(drf, V).float()
        assert all(torch.equal(a, b) for a, b in zip(greedy_verify(tgt, drf),
                                                     rejection_sample(p, q, drf, generator=g)))


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="shape mismatch"):
        rejection_sample(torch.rand(1, 3, 5), torch.rand(1, 3, 5), torch.zeros(1, 3, dtype=torch.long))


def test_the_residual_is_drawn_from_without_normalising_it():
    """The recovered token is multinomial's draw from the residual max(0, p − q), which needs
    no division by its mass: one vocabulary-wide division per call, the draw's own."""
    from opcount import OpCounter

    V, k = 1000, 3
    g = torch.Generator().manual_seed(0)
    p = torch.rand(1, k + 1, V, generator=g).softmax(-1)
    q = torch.rand(1, k, V, generator=g).softmax(-1)
    toks = torch.randint(0, V, (1, k), generator=g)
    with OpCounter(width=V) as ops:
        rejection_sample(p, q, toks, generator=torch.Generator().manual_seed(1))
    assert ops.counts["div"] == 1, ops.counts
    # and the draw is multinomial's from the unnormalised residual, token for token
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        m, nxt = rejection_sample(p, q, toks, generator=gen)
        state = torch.Generator().manual_seed(seed)
        torch.rand((1, k), generator=state)  # the acceptance draws
        at = int(m)
        qn = q[0, at] if at < k else torch.zeros(V)
        want = torch.multinomial((p[0, at] - qn).clamp_min(0), 1, generator=state)
        assert int(nxt) == int(want)
