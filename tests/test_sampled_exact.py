"""Sampled output is distributed exactly as ``generate``'s: the empirical joint distribution of
the first two generated tokens over thousands of seeded runs against the law ``generate``
itself samples from, read from its own processed scores (``output_scores``: the logits
processors and warpers it builds for the request: repetition penalty, min-new-tokens EOS
suppression, temperature, top-k, top-p, min-p), so a processing step autospec gets wrong, drops
or applies at the wrong position shows up here. No autospec code builds the reference.

Each chi-square test has a false-alarm rate of ALPHA = 1e-3 over seeds; the seeds are fixed, so
CI is deterministic. Each case also carries "near misses": the law of the nearest plausible bug
(the processing step left out, the EOS ban one position off, the draft's samples emitted
unverified), which the same counts must reject, so every case shows it has the power to fail.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import autospec
from autospec.policies import ThompsonBandit

from conftest import noisy_copy, prompt, tiny
from test_verify import ALPHA, _chi2_pvalue

V = 8
RUNS = 2000
EOS_ID = 4  # the EOS id of the min_new_tokens case: likely at both positions (checked below)
# the draft must really disagree: at least this share of its proposals rejected, in every case
# (measured 0.28-0.42 here; an agreeing draft would exercise only the acceptance path)
MIN_REJECTED = 0.2


def exact_joint(model, ids: torch.Tensor, **gen_kwargs) -> torch.Tensor:
    """P(t1, t2) = p(t1 | prompt) · p(t2 | prompt, t1) as ``model.generate`` samples them,
    enumerated: [V, V]. p(t1) is the softmax of generate's own processed scores for step 1;
    p(t2 | t1) those of step 2 in a batch whose row t1 was forced to emit t1 at step 1
    (``prefix_allowed_tokens_fn``, a no-op at step 2), so that generate counts new tokens,
    seen tokens and positions exactly as it does when it sampled t1 itself."""
    L = ids.shape[1]
    kw = dict(do_sample=True, output_scores=True, return_dict_in_generate=True,
              pad_token_id=0, eos_token_id=None) | gen_kwargs

    def force_t1(row: int, seq: torch.Tensor) -> list[int]:
        return [row] if seq.shape[-1] == L else list(range(V))

    with torch.no_grad(), warnings.catch_warnings():
        # a near miss banning EOS past max_new_tokens: generate warns, and computes it anyway
        warnings.filterwarnings("ignore", "Unfeasible length constraints")
        first = model.generate(ids, max_new_tokens=1, **kw).scores[0][0].double().softmax(-1)
        out = model.generate(ids.repeat(V, 1), max_new_tokens=2, prefix_allowed_tokens_fn=force_t1,
                             **kw)
    assert torch.equal(out.sequences[:, L], torch.arange(V))
    second = out.scores[1].double().softmax(-1)  # [t1, t2]
    return (first[:, None] * second).float()


def empirical(spec, ids, k, gen_kwargs, seed) -> tuple[torch.Tensor, int, int]:
    """Counts of (t1, t2) over RUNS seeded calls, and the draft tokens proposed and rejected.
    k=None: the controller's policy chooses k every iteration."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V, dtype=torch.long)
    drafted = rejected = 0
    L = ids.shape[1]
    kw = dict(eos_token_id=None) | gen_kwargs
    for _ in range(RUNS):
        out = spec.generate(ids, max_new_tokens=2, do_sample=True, k=k, generator=g, **kw)
        # only the min_new_tokens case has an EOS, and it is banned at t1
        assert out.shape[1] == L + 2, f"stopped at EOS {out[0, L:].tolist()} before min_new_tokens"
        counts[out[0, L] * V + out[0, L + 1]] += 1
        st = spec.last_stats
        drafted += st.drafted
        rejected += st.drafted - st.accepted
    return counts, drafted, rejected


@pytest.fixture(scope="module")
def sampled_pair():
    # peaked enough that the chi-square cells fill, flat enough that many cells have mass
    target = tiny("llama", vocab=V, sharpen=4.0, seed=3)
    draft = noisy_copy(target, 2.0, seed=4)  # total variation 0.3-0.45 from the target
    return target, draft


# (k, generate kwargs, near misses: generate kwargs of wrong laws the counts must reject;
#  "draft" = the draft's own law, i.e. draft samples emitted without verification)
CASES = {
    "plain": (1, dict(top_k=0), ["draft"]),
    "temperature": (2, dict(temperature=0.7, top_k=0), [dict(top_k=0)]),
    # a strong penalty: at t2 it must count t1 (an accepted draft token) as seen
    "top_k+top_p+repetition": (3, dict(top_k=6, top_p=0.9, repetition_penalty=3.0),
                               [dict(top_k=6, top_p=0.9), dict(top_k=0, repetition_penalty=3.0)]),
    "min_p": (2, dict(temperature=1.5, min_p=0.3, top_k=0),
              [dict(temperature=1.5, top_k=0)]),
    # EOS banned at step 1 only: a ban left out or held one position too long is rejected
    "min_new_tokens": (4, dict(min_new_tokens=1, eos_token_id=EOS_ID, top_k=0),
                       [dict(top_k=0), dict(min_new_tokens=2, eos_token_id=EOS_ID, top_k=0)]),
    "bandit": (None, dict(top_k=0), ["draft"]),  # the bandit picks k from 0…8 as it learns
}


@pytest.mark.parametrize("case", CASES)
def test_first_two_tokens_follow_generates_joint_distribution(sampled_pair, case):
    target, draft = sampled_pair
    k, gen_kwargs, near_misses = CASES[case]
    policy = ThompsonBandit(k_max=8, seed=0) if k is None else 4
    spec = autospec.Controller(target, draft, store=False, policy=policy)  # no logging here
    ids = prompt(6, seed=1, vocab=V)
    counts, drafted, rejected = empirical(spec, ids, k, gen_kwargs, seed=10 + (k or 0))
    assert _chi2_pvalue(counts, exact_joint(target, ids, **gen_kwargs).flatten()) > ALPHA
    # the draft disagrees often enough for the residual distribution to be exercised
    assert drafted > 0 and rejected >= MIN_REJECTED * drafted, (rejected, drafted)
    for wrong in near_misses:  # power: the same counts reject the nearest wrong laws
        law = (exact_joint(draft, ids, **gen_kwargs) if wrong == "draft"
               else exact_joint(target, ids, **wrong))
        assert _chi2_pvalue(counts, law.flatten()) < ALPHA, wrong


def test_the_eos_case_can_tell_where_the_ban_ends(sampled_pair):
    # the min_new_tokens case means something only if EOS is likely at both positions
    target, _ = sampled_pair
    ids = prompt(6, seed=1, vocab=V)
    free = exact_joint(target, ids, top_k=0)
    banned = exact_joint(target, ids, top_k=0, min_new_tokens=1, eos_token_id=EOS_ID)
    assert free.sum(1)[EOS_ID] > 0.05 and free.sum(0)[EOS_ID] > 0.05
    assert banned.sum(1)[EOS_ID] == 0 and banned.sum(0)[EOS_ID] > 0.05


def generate_scores_along(model, ids: torch.Tensor, tokens: list[int], **gen_kwargs):
    """generate's own processed scores at each position of a continuation it did not choose:
    row j of one batch is forced (``prefix_allowed_tokens_fn``) to emit tokens[:j], then scores
    position j freely, so generate counts new tokens and seen tokens as if it had sampled them.
    Returns [len(tokens), V]."""
    L, n = ids.shape[1], len(tokens)

    def force(row: int, seq: torch.Tensor) -> list[int]:
        t = seq.shape[-1] - L
        return [tokens[t]] if t < row else list(range(model.config.vocab_size))

    with torch.no_grad():
        out = model.generate(ids.repeat(n, 1), max_new_tokens=n, prefix_allowed_tokens_fn=force,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             **gen_kwargs)
    return torch.stack([out.scores[j][j] for j in range(n)]).float()


# min_new_tokens = 5: generate's MinNewTokensLengthLogitsProcessor bans EOS at positions 0-4
# (an EOS the seeded run does not emit too early, so that positions past the ban are scored)
SCORE_EOS = 0
SCORED = {
    "sampled": dict(do_sample=True, temperature=0.7, top_k=7, top_p=0.95, min_p=0.02,
                    repetition_penalty=1.3, min_new_tokens=5, eos_token_id=SCORE_EOS),
    "greedy": dict(do_sample=False, repetition_penalty=1.3, min_new_tokens=5,
                   eos_token_id=SCORE_EOS),
}


@pytest.mark.parametrize("case", SCORED)
def test_scores_at_every_position_are_generates(sampled_pair, case):
    """The target distribution the rejection rule uses, position by position (inside accepted
    blocks too), equals generate's processed scores: its EOS ban before min_new_tokens
    (MinNewTokensLengthLogitsProcessor), repetition penalty over accepted draft tokens, and
    warpers. Exact up to float rounding, no statistics."""
    target, _ = sampled_pair
    draft = noisy_copy(target, 0.5, seed=4)  # close enough that blocks are accepted whole
    spec = autospec.Controller(target, draft, store=False)
    ids = prompt(6, seed=1, vocab=V)
    out = spec.generate(ids, max_new_tokens=12, k=3, output_scores=True,
                        return_dict_in_generate=True, generator=torch.Generator().manual_seed(2),
                        **SCORED[case])
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    assert len(tokens) >= 8 and len(out.scores) == len(tokens)
    # the ban's end (position 5) falls inside a block that started before it, so the loop has
    # to switch the ban off mid-block, as generate does one token at a time
    starts = torch.tensor([0] + spec.last_stats.accepted_schedule).add(1).cumsum(0) - 1
    ends = starts[:-1] + torch.tensor(spec.last_stats.accepted_schedule)
    assert ((starts[:-1] < 5) & (ends >= 5)).any(), spec.last_stats.accepted_schedule
    ref = generate_scores_along(target, ids, tokens, **SCORED[case])
    ours = torch.cat(out.scores).float()
    # the case means something: EOS banned before min_new_tokens, allowed after it
    assert torch.isinf(ref[:5, SCORE_EOS]).all() and torch.isfinite(ref[5:, SCORE_EOS]).any()
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite], ref[finite], atol=1e-4, rtol=1e-4)


def test_torch_manual_seed_governs_sampling_like_generate(sampled_pair):
    target, draft = sampled_pair
    spec = autospec.Controller(target, draft, store=False)  # thousands of calls: no logging
    ids = prompt(6, seed=2, vocab=V)

    def run(seed):
        torch.manual_seed(seed)
        return spec.generate(ids, max_new_tokens=20, do_sample=True, eos_token_id=None, k=3)

    assert torch.equal(run(5), run(5))
    assert any(not torch.equal(run(5), run(s)) for s in (6, 7, 8))

    def unwrapped(seed):
        torch.manual_seed(seed)
        return target.generate(ids, max_new_tokens=20, do_sample=True, eos_token_id=None)

    # the same law, not the same stream (docs/exactness.md): one seed, other tokens
    assert any(not torch.equal(run(s), unwrapped(s)) for s in (5, 6, 7))


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
