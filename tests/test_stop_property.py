"""Every row stops exactly where ``generate`` stops it, whatever the rows' speeds.

A property test over random calls: B in 1…8, left-padded prompts, every proposer and policy,
every way a call stops (an EOS id or none or several, ``max_new_tokens``, ``max_length``,
``stop_strings``, ``max_time``, a stopping criterion on the length or on a token), compared
token for token — and in shape — with the target's own batched greedy ``generate``.

Rows must progress at very different speeds for the batch's stopping rule to matter: without
an EOS id ``generate`` stops every row at the step where the last one is stopped, so a row
that drafts well runs ahead of that step and must be cut back. The target here is built so
that its greedy output is known (``autospec.testing.controlled``): tokens 4–9 form a short
cycle, which prompt lookup and suffix decoding predict almost perfectly after one turn, and
the other tokens one long cycle, which they never predict; the draft model agrees with it on
most tokens. A second pair (a random tiny model and a noisy copy) adds ordinary contexts.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import autospec
from autospec.testing.controlled import build_model, make_controlled, qwen2_config

from conftest import VOCAB, noisy_copy, tiny, tiny_tokenizer

CASES = 520
CHUNK = 40  # cases per test item
SHORT = list(range(4, 10))  # the short cycle
POLICIES = ("ngram:8", "suffix:8", "fixed:8", "fixed:3", "hybrid:6:1", "auto", "ngram:2")


class LengthAtLeast(StoppingCriteria):
    """Stops every row once the sequence (padding included) is ``n`` long."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n,
                          dtype=torch.bool, device=input_ids.device)


class LastTokenIs(StoppingCriteria):
    """Stops a row when its last token is ``token``."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _successors(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """succ, pred of a short cycle through ``SHORT`` and one long cycle through the rest."""
    rng = random.Random(seed)
    rest = [t for t in range(VOCAB) if t not in SHORT]
    rng.shuffle(rest)
    succ = torch.arange(VOCAB)
    for cycle in (SHORT, rest):
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            succ[a] = b
    pred = torch.empty(VOCAB, dtype=torch.long)
    pred[succ] = torch.arange(VOCAB)
    return succ, pred


def _controlled_pair():
    succ, pred = _successors(0)
    target = build_model(qwen2_config("tiny"))
    make_controlled(target, pred, seed=1)
    # the draft: the same successors, but wrong after a quarter of the long cycle's tokens
    rng = random.Random(2)
    wrong = rng.sample([t for t in range(VOCAB) if t not in SHORT], VOCAB // 4)
    d_succ = succ.clone()
    for a, b in zip(wrong, wrong[1:] + wrong[:1]):
        d_succ[a] = succ[b]
    d_pred = torch.empty(VOCAB, dtype=torch.long)
    d_pred[d_succ] = torch.arange(VOCAB)
    draft = build_model(qwen2_config("tiny"))
    make_controlled(draft, d_pred, seed=3)
    return target, draft


@pytest.fixture(scope="module")
def pairs():
    random_target = tiny("llama", sharpen=30.0)
    return {"controlled": _controlled_pair(),
            "random": (random_target, noisy_copy(random_target, 0.4))}


@pytest.fixture(scope="module")
def controllers(pairs):
    """One controller per (pair, policy), reused across cases (suffix memory grows)."""
    tok = tiny_tokenizer()
    made = {}

    def get(pair: str, policy: str):
        if (pair, policy) not in made:
            target, draft = pairs[pair]
            made[pair, policy] = autospec.Controller(target, draft, store=False,
                                                     policy=policy, tokenizer=tok)
        return made[pair, policy]

    yield get
    for c in made.values():
        c.close()


def _case(i: int):
    """The i-th random call: (pair, policy, input_ids, attention_mask, generate kwargs)."""
    rng = random.Random(1000 + i)
    pair = rng.choice(("controlled", "controlled", "random"))
    policy = rng.choice(POLICIES)
    B = rng.randint(1, 8)
    lens = [rng.randint(3, 12) for _ in range(B)]
    width = max(lens)
    ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.long)
    for b, n in enumerate(lens):
        if rng.random() < 0.5:  # a row that runs fast: it starts in the short cycle
            start = rng.randrange(len(SHORT))
            row = [SHORT[(start + j) % len(SHORT)] for j in range(n)]
        else:
            row = [rng.randrange(4, VOCAB) for _ in range(n)]
        ids[b, width - n :] = torch.tensor(row)
        mask[b, width - n :] = 1
    kw = dict(do_sample=False, max_new_tokens=rng.randint(6, 40))
    eos = rng.random()
    if eos < 0.45:
        kw["eos_token_id"] = None
    elif eos < 0.8:
        kw["eos_token_id"] = rng.randrange(4, VOCAB)
    else:
        kw["eos_token_id"] = [rng.randrange(4, VOCAB) for _ in range(2)]
    kinds = rng.sample(("length", "token", "stop_strings", "max_time", "max_length", "none"),
                       rng.randint(1, 2))
    criteria = []
    for kind in kinds:
        if kind == "length":
            criteria.append(LengthAtLeast(width + rng.randint(1, 30)))
        elif kind == "token":
            criteria.append(LastTokenIs(rng.choice(SHORT + [rng.randrange(4, VOCAB)])))
        elif kind == "stop_strings":
            kw["stop_strings"] = [f"w{rng.randrange(4, VOCAB - 1)}"]
        elif kind == "max_time":
            kw["max_time"] = rng.choice((0.0, 1e6))  # stops at the first token, or never
        elif kind == "max_length":
            kw["max_length"] = width + rng.randint(1, 30)
            del kw["max_new_tokens"]
    if criteria:
        kw["stopping_criteria"] = StoppingCriteriaList(criteria)
    if rng.random() < 0.2:
        kw.update(return_dict_in_generate=True, output_scores=True)
    return pair, policy, ids, mask, kw


def _describe(i, pair, policy, ids, kw) -> str:
    shown = {k: (type(v).__name__ if k == "stopping_criteria" else v) for k, v in kw.items()}
    return f"case {i}: {pair} pair, policy {policy}, B={ids.shape[0]}, {shown}"


@pytest.mark.parametrize("chunk", range(CASES // CHUNK))
def test_every_row_stops_where_generate_stops_it(chunk, pairs, controllers):
    tok = tiny_tokenizer()
    for i in range(chunk * CHUNK, (chunk + 1) * CHUNK):
        pair, policy, ids, mask, kw = _case(i)
        target, _ = pairs[pair]
        spec = controllers(pair, policy)
        if "stop_strings" in kw:
            kw["tokenizer"] = tok
        ref = spec._original_generate(ids, attention_mask=mask, **kw)
        out = spec.generate(ids, attention_mask=mask, **kw)
        what = _describe(i, pair, policy, ids, kw)
        assert spec.last_stats is not None, f"{what}: not served ({spec.fallbacks})"
        if kw.get("return_dict_in_generate"):
            assert len(out.scores) == len(ref.scores), what
            ref, out = ref.sequences, out.sequences
        assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, generate's " \
                                       f"{tuple(ref.shape)}"
        assert torch.equal(out, ref), what
