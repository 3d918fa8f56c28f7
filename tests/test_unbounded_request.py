"""A request's ``max_new_tokens`` is a bound, not a size: servers pass a client's straight
through. The engine sizes its buffers by what the first iterations reach and grows them, so a
request of ``max_new_tokens=10**10`` that stops early costs what it generates — where sizing
by the request asked for B × 10**10 tokens up front and failed."""

from __future__ import annotations

import logging

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import autospec
from autospec.engine.batch import TOKENS_AHEAD

from conftest import EOS, noisy_copy, prompt, tiny


class StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length,
                          dtype=torch.bool)


def _rows(n: int):
    ids = torch.cat([prompt(8, seed=s) for s in range(n)])
    return ids, torch.ones_like(ids)


def test_a_huge_max_new_tokens_is_served_as_generate_serves_it():
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    for rows in (1, 3):
        ids, mask = _rows(rows)
        kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=10**10,
                  eos_token_id=EOS, stopping_criteria=StoppingCriteriaList([StopAfter(30)]))
        ref = target.generate(ids, **kw)
        out = spec.generate(ids, k=4, **kw)
        assert spec.last_stats is not None
        assert torch.equal(out, ref)


def test_the_static_path_runs_eager_for_a_request_past_the_models_positions(caplog):
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False, static_cache=True)
    ids, mask = _rows(1)
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=EOS,
              stopping_criteria=StoppingCriteriaList([StopAfter(24)]))
    with caplog.at_level(logging.WARNING, logger="autospec.engine.runners"):
        out = spec.generate(ids, k=3, max_new_tokens=10**10, **kw)
    assert torch.equal(out, target.generate(ids, max_new_tokens=10**10, **kw))
    assert spec.last_stats.path == "eager"
    assert any("past the model's 256 positions" in r.getMessage() for r in caplog.records)
    spec.generate(ids, k=3, max_new_tokens=20, **kw)  # one that fits stays static
    assert spec.last_stats.path == "static"


def test_rows_run_past_the_first_buffer_exactly():
    """More new tokens than the token buffer holds at first: it grows on demand."""
    target = tiny("qwen2", sharpen=30.0, max_pos=1024)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    ids, mask = _rows(2)
    mask[1, :3], ids[1, :3] = 0, 0
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=TOKENS_AHEAD + 60,
              eos_token_id=None)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, k=6, **kw)
    assert out.shape[1] == ids.shape[1] + TOKENS_AHEAD + 60
    assert torch.equal(out, ref)
    assert len(spec.last_row_stats[0].trace) == TOKENS_AHEAD + 60
