"""Sampled output is distributed exactly as the target's: the empirical joint distribution of
the first two generated tokens over thousands of seeded runs against the target's exact
distribution, enumerated on a tiny vocabulary. Each chi-square test has a false-alarm rate of
ALPHA over seeds (the seeds are fixed, so CI is deterministic)."""

from __future__ import annotations

import pytest
import torch

import autospec
from autospec.policies import ThompsonBandit
from autospec.sampling import SamplingConfig, logits_to_probs, process_logits, seen_tokens

from conftest import noisy_copy, prompt, tiny
from test_verify import ALPHA, _chi2_pvalue

V = 8
RUNS = 3000


def exact_joint(target, ids, cfg: SamplingConfig) -> torch.Tensor:
    """P(t1, t2) = p(t1 | prompt) · p(t2 | prompt, t1), enumerated: [V, V]."""
    with torch.no_grad():
        seqs = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], dim=1)  # [V, L+1]
        logits = target(seqs).logits[:, -2:].float()  # positions predicting t1 and t2
        seen = None
        if cfg.uses_presence:
            seen = torch.stack([seen_tokens(seqs[:, :-1], V), seen_tokens(seqs, V)], dim=1)
        probs = logits_to_probs(process_logits(logits, cfg, seen=seen), cfg)
    return probs[0, 0][:, None] * probs[:, 1]  # [V, V]


def empirical(spec, ids, k, gen_kwargs, seed) -> torch.Tensor:
    """k=None: the controller's policy chooses k every iteration."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V, dtype=torch.long)
    L = ids.shape[1]
    for _ in range(RUNS):
        out = spec.generate(ids, max_new_tokens=2, do_sample=True, eos_token_id=None, k=k,
                            generator=g, **gen_kwargs)
        counts[out[0, L] * V + out[0, L + 1]] += 1
    return counts


@pytest.fixture(scope="module")
def sampled_pair():
    target = tiny("llama", vocab=V, sharpen=25.0, seed=3)
    draft = noisy_copy(target, 1.0, seed=4)
    return target, draft


CASES = [
    (1, dict(top_k=0)),
    (2, dict(temperature=0.8, top_k=0)),
    (3, dict(top_k=5, top_p=0.9, repetition_penalty=1.3)),
    (None, dict(top_k=0)),  # the bandit picks k from 0…8 as it learns: still exact
]


@pytest.mark.parametrize("k,gen_kwargs", CASES)
def test_first_two_tokens_follow_the_target_joint_distribution(sampled_pair, k, gen_kwargs):
    target, draft = sampled_pair
    policy = ThompsonBandit(k_max=8, seed=0) if k is None else 4
    spec = autospec.Controller(target, draft, store=False, policy=policy)  # no logging here
    ids = prompt(6, seed=1, vocab=V)
    gc = target.generation_config
    cfg = SamplingConfig(do_sample=True, temperature=gen_kwargs.get("temperature", 1.0),
                         top_k=gen_kwargs.get("top_k") or None, top_p=gen_kwargs.get("top_p"),
                         repetition_penalty=gen_kwargs.get("repetition_penalty",
                                                           gc.repetition_penalty))
    joint = exact_joint(target, ids, cfg).flatten()
    counts = empirical(spec, ids, k, gen_kwargs, seed=10 + (k or 0))
    assert _chi2_pvalue(counts, joint) > ALPHA
    # the draft must disagree often enough for the test to mean something
    assert spec.last_stats is not None


def test_the_joint_test_detects_a_wrong_distribution(sampled_pair):
    # power check: the draft's own samples fail the same test against the target's joint
    target, draft = sampled_pair
    ids = prompt(6, seed=1, vocab=V)
    cfg = SamplingConfig(do_sample=True)
    joint = exact_joint(target, ids, cfg).flatten()
    spec = autospec.Controller(draft, draft, store=False)
    counts = empirical(spec, ids, 1, dict(top_k=0), seed=99)
    assert _chi2_pvalue(counts, joint) < ALPHA


def test_torch_manual_seed_governs_sampling_like_generate(sampled_pair):
    target, draft = sampled_pair
    spec = autospec.Controller(target, draft, store=False)  # thousands of calls: no logging
    ids = prompt(6, seed=2, vocab=V)

    def run(seed):
        torch.manual_seed(seed)
        return spec.generate(ids, max_new_tokens=20, do_sample=True, eos_token_id=None, k=3)

    assert torch.equal(run(5), run(5))
    assert any(not torch.equal(run(5), run(s)) for s in (6, 7, 8))


@pytest.mark.parametrize("broken", ["target", "draft"])
def test_nan_probabilities_raise_as_generate_does(broken):
    """`sample` skips multinomial's per-draw validity sync; the loop checks on its own sync
    instead, so a model whose distribution is NaN fails loudly (as generate does), naming it,
    rather than emitting arbitrary tokens."""
    target = tiny("llama", vocab=V, sharpen=25.0, seed=3)
    draft = noisy_copy(target, 1.0, seed=4)
    ids = prompt(6, seed=2, vocab=V)
    with torch.no_grad():
        (target if broken == "target" else draft).lm_head.weight[5, 0] = float("nan")
    if broken == "target":  # generate itself refuses this model
        with pytest.raises(RuntimeError, match="probability tensor"):
            target.generate(ids, max_new_tokens=4, do_sample=True, eos_token_id=None)
    spec = autospec.Controller(target, draft, store=False)
    with pytest.raises(RuntimeError, match=f"the {broken} model's next-token probabilities "
                                           "contain NaN"):
        spec.generate(ids, max_new_tokens=4, do_sample=True, eos_token_id=None, k=2)
    # greedy needs no probabilities: argmax of a NaN row is what generate does as well
    if broken == "draft":
        out = spec.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, k=2)
        assert torch.equal(out, target.generate(ids, max_new_tokens=4, do_sample=False,
                                                eos_token_id=None))
