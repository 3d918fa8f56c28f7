"""Greedy speculative output equals the target's own greedy generate, token for token (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

import autospec
from autospec.policies import Context

from conftest import noisy_copy, prompt, tiny


def reference(target, ids, **kw):
    return target.generate(ids, do_sample=False, **kw)


@pytest.mark.parametrize("k", range(1, 9))
def test_identical_to_generate_for_every_k(pair, k):
    target, draft = pair
    spec = autospec.Controller(target, draft)
    for seed in range(3):
        ids = prompt(8 + seed, seed=seed)
        ref = reference(target, ids, max_new_tokens=30)
        out = spec.generate(ids, max_new_tokens=30, do_sample=False, k=k)
        assert torch.equal(out, ref), (k, seed)
    assert spec.last_stats.drafted > 0


def test_acceptance_is_partial_so_rejections_are_exercised(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft)
    accepted = drafted = 0
    for seed in range(4):
        spec.generate(prompt(10, seed=seed), max_new_tokens=30, do_sample=False, k=4)
        accepted += spec.last_stats.accepted
        drafted += spec.last_stats.drafted
    assert 0 < accepted < drafted


def test_eos_inside_an_accepted_block_ends_the_output(arch):
    # a draft close to the target accepts long blocks; make a token from the middle of the
    # reference output the EOS, so it lands inside a block with accepted tokens after it
    target = tiny(arch, sharpen=30.0)
    draft = noisy_copy(target, 0.05)
    spec = autospec.Controller(target, draft)
    hits = 0
    for seed in range(6):
        ids = prompt(10, seed=seed)
        free = reference(target, ids, max_new_tokens=40, eos_token_id=None)[0, ids.shape[1]:]
        # first token from position 5 on that did not occur before it
        cands = [i for i in range(5, 30) if int(free[i]) not in free[:i].tolist()]
        if not cands:
            continue
        eos = int(free[cands[0]])
        ref = reference(target, ids, max_new_tokens=40, eos_token_id=eos)
        out = spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos, k=6)
        assert torch.equal(out, ref)
        assert out[0, -1].item() == eos and spec.last_stats.stop_reason == "eos"
        hits += 1
    assert hits >= 3


def test_several_eos_ids_and_min_new_tokens(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft)
    ids = prompt(10, seed=3)
    free = reference(target, ids, max_new_tokens=30, eos_token_id=None)[0, 10:].tolist()
    eos = [free[2], free[7]]  # a token early on, suppressed by min_new_tokens, and another
    for min_new in (0, 5, 12):
        ref = reference(target, ids, max_new_tokens=30, eos_token_id=eos, min_new_tokens=min_new)
        out = spec.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                            min_new_tokens=min_new, k=4)
        assert torch.equal(out, ref), min_new


def test_k_changing_every_iteration(pair):
    target, draft = pair
    rng = random.Random(0)

    def chaotic(ctx: Context) -> int:
        return rng.randint(0, 8)

    spec = autospec.Controller(target, draft, policy=chaotic)
    for seed in range(3):
        ids = prompt(9, seed=seed)
        assert torch.equal(spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None),
                           reference(target, ids, max_new_tokens=40, eos_token_id=None))
    assert 0 in spec.last_stats.k_schedule and max(spec.last_stats.k_schedule) > 1


def test_k_zero_is_plain_decoding_and_never_runs_the_draft(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, policy="off")
    ids = prompt(9)
    assert torch.equal(spec.generate(ids, max_new_tokens=20, do_sample=False),
                       reference(target, ids, max_new_tokens=20))
    assert spec.last_stats.draft_forwards == 0 and spec.last_stats.iterations == 20


def test_repetition_penalty_matches(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft)
    ids = prompt(12, seed=1)
    ref = reference(target, ids, max_new_tokens=30, repetition_penalty=1.5)
    out = spec.generate(ids, max_new_tokens=30, do_sample=False, repetition_penalty=1.5, k=5)
    assert torch.equal(out, ref)


def test_draft_equal_to_target_accepts_everything(arch):
    target = tiny(arch, sharpen=30.0)
    spec = autospec.Controller(target, target)
    ids = prompt(10)
    out = spec.generate(ids, max_new_tokens=25, do_sample=False, k=4)
    assert torch.equal(out, reference(target, ids, max_new_tokens=25))
    assert spec.last_stats.acceptance == 1.0
    assert spec.last_stats.mean_accepted_length > 4


def test_max_new_tokens_is_exact_whatever_k(pair):
    target, draft = pair
    spec = autospec.Controller(target, target)
    for n in (1, 2, 7, 13):
        out = spec.generate(prompt(5), max_new_tokens=n, do_sample=False, eos_token_id=None, k=8)
        assert out.shape[1] == 5 + n


def test_draft_with_padded_vocabulary(arch):
    # embedding matrices are often padded past the tokenizer: ids a model lacks get p = 0
    target = tiny(arch, vocab=97, sharpen=30.0)
    draft = tiny(arch, vocab=97, layers=1, seed=1, sharpen=30.0)
    wide = tiny(arch, vocab=128, layers=1, seed=1)
    with torch.no_grad():
        wide.model.embed_tokens.weight[:97] = draft.model.embed_tokens.weight
        wide.lm_head.weight[:97] = draft.lm_head.weight
        wide.lm_head.weight[97:] = -10 * draft.lm_head.weight[:31]  # padding rows: unlikely
        for a, b in zip(wide.model.layers.parameters(), draft.model.layers.parameters()):
            a.copy_(b)

    class Tok:  # the tokenizer both share: 97 tokens
        def __len__(self):
            return 97

    spec = autospec.Controller(target, wide, tokenizer=Tok())
    ids = prompt(10)
    assert torch.equal(spec.generate(ids, max_new_tokens=20, do_sample=False, k=3),
                       reference(target, ids, max_new_tokens=20))


@pytest.mark.parametrize("policy", ["auto", "costmodel", "bandit", "heuristic",
                                    "costmodel+stop=0.6", "fixed:5+stop=0.9"])
def test_identical_whatever_the_policy_does(pair, policy):
    target, draft = pair
    spec = autospec.Controller(target, draft, policy=policy, store=False)
    for seed in range(3):
        ids = prompt(9, seed=seed)
        out = spec.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
        assert torch.equal(out, reference(target, ids, max_new_tokens=30, eos_token_id=None))


def test_early_stopping_drafts_fewer_tokens_than_k(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, policy="fixed:8+stop=0.99", store=False)
    spec.generate(prompt(9), max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert 0 < min(k for k in spec.last_stats.k_schedule[:-1]) < 8
