"""What works at batch 1 works at B > 1 (docs/engine.md, "Features by batch size and path"),
and what a policy may answer.

- Draft-side early stopping at B > 1: each row's block ends where the draft lost confidence
  for that row, drafting stops once every row has, and every row stays generate's.
- The categoriser's forecast and the request's own statistics reach the policy per row.
- ``last_stats`` counts every proposer under names that say what they count.
- A policy that answers something other than a k is named with what it answered.
"""

from __future__ import annotations

import pytest
import torch
from test_ngram import _repetitive

import autospec
from autospec.engine.generate import run
from autospec.engine.sampling import SamplingConfig
from autospec.policies import Choice, FixedK
from autospec.policies.base import EarlyStop

from conftest import noisy_copy, prompt, tiny


@pytest.fixture(scope="module")
def models():
    target = tiny("llama", sharpen=30.0)
    return target, noisy_copy(target, 0.6)


def test_early_stopping_ends_each_rows_block_on_its_own_at_batch(models):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=EarlyStop(FixedK(6), 0.9))
    ids = torch.cat([prompt(10, seed=s) for s in range(3)])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
              eos_token_id=None)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, **kw)
    assert torch.equal(out, ref) and not spec.fallbacks
    rows = spec.last_row_stats
    # some iteration gave rows blocks of different lengths: each stopped on its own
    ragged = sum(len({st.k_schedule[i] for st in rows if i < len(st.k_schedule)}) > 1
                 for i in range(max(st.iterations for st in rows)))
    assert ragged > 0
    assert min(k for st in rows for k in st.k_schedule if k) < 6


class Spy:
    name = "spy"

    def __init__(self):
        self.seen = []

    def choose(self, ctx):
        self.seen.append((ctx.batch_size, ctx.predicted_alphas, ctx.requests, ctx.remaining_rows))
        return 2

    def update(self, ctx, k, outcome):
        pass


def test_forecasts_and_request_statistics_reach_the_policy_per_row(models):
    target, draft = models
    spy = Spy()
    prompts = [prompt(8 + 2 * s, seed=s) for s in range(3)]
    run(target, draft, prompts, sampling=SamplingConfig(), policy=spy, max_new_tokens=12,
        forecasts=[0.2, None, 0.9])
    batch, alphas, requests, left = spy.seen[0]
    assert batch == 3 and alphas == (0.2, None, 0.9) and left == (12, 12, 12)
    assert len({id(r) for r in requests}) == 3  # each row its own
    # each row's own statistics grow with its own blocks
    last = next(s for s in reversed(spy.seen) if s[0] == 3)
    assert all(r.iterations > 0 for r in last[2])
    alone = Spy()
    run(target, draft, prompts[:1], sampling=SamplingConfig(), policy=alone,
        max_new_tokens=6, forecasts=[0.4])
    assert alone.seen[0][:2] == (1, (0.4,))


def test_last_stats_counts_every_proposer_by_name(models):
    target, _draft = models
    spec = autospec.Controller(target, store=False, policy="ngram:4")  # prompt lookup alone
    ids = _repetitive(1)
    spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                  do_sample=False)
    st = spec.last_stats
    lookup, model = st.proposer("ngram"), st.proposer("draft")
    assert lookup.proposed > 0 and model.proposed == 0
    assert st.proposed == lookup.proposed == st.proposer("ngram").proposed
    assert st.proposed_accepted == lookup.accepted
    suffix = st.proposer("suffix")  # not asked for: none of its blocks
    assert suffix.blocks == suffix.proposed == 0
    # every proposer the call had, by name: not the draft model's (no draft model) nor
    # suffix decoding's (no memory to open it with)
    assert st.by_proposer == {"ngram": lookup}
    assert sum(lookup.proposed_per_position) >= lookup.proposed // 4
    # with a suffix memory the call opens suffix decoding too: listed, with zeros, though
    # the policy never asked it for a block
    spec = autospec.Controller(target, store=False, policy="ngram:4", suffix=True)
    spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                  do_sample=False)
    st = spec.last_stats
    assert st.proposer("ngram").proposed > 0 and st.proposer("suffix").proposed == 0
    assert st.by_proposer == {"ngram": st.proposer("ngram"), "suffix": suffix}


@pytest.mark.parametrize("answer,error", [
    (None, TypeError), (2.7, TypeError), ("3", TypeError), (True, TypeError),
    (-1, ValueError)])
def test_a_policys_answer_that_is_not_a_k_is_named(models, answer, error):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=lambda ctx: answer)
    ids = prompt(8)
    with pytest.raises(error, match=r"policy 'callable' returned"):
        spec.generate(ids, max_new_tokens=5, do_sample=False)


def test_a_k_beyond_k_max_is_clamped_and_a_choice_is_a_k(models):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, k_max=4, policy=lambda ctx: 60)
    ids = prompt(8)
    spec.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert max(spec.last_stats.k_schedule) == 4
    spec = autospec.Controller(target, draft, store=False,
                               policy=lambda ctx: Choice(3, "draft"))
    spec.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert max(spec.last_stats.k_schedule) == 3
