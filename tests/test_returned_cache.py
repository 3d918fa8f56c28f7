"""``return_dict_in_generate=True`` returns the cache where it can, and says where it cannot.

At batch 1 on the eager path the output carries the target's cache as ``generate``'s does:
every token of the sequence but the last, the same keys and values. At batch > 1 finished rows
leave the engine's cache early, and a static cache is reused by the next request: there the
field is None and the reason is logged once.
"""

from __future__ import annotations

import logging

import torch

import autospec

from conftest import noisy_copy, prompt, tiny


def _cache(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def test_batch_one_returns_the_targets_cache_as_generate_does():
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    ids = prompt(10)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
              return_dict_in_generate=True, eos_token_id=None)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, k=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    mine, theirs = _cache(out), _cache(ref)
    assert mine is not None
    assert mine.get_seq_length() == theirs.get_seq_length() == ref.sequences.shape[1] - 1
    for a, b in zip(mine.layers, theirs.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)


def test_a_batch_returns_no_cache_and_says_why(caplog):
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    ids = torch.cat([prompt(10, seed=s) for s in range(2)])
    with caplog.at_level(logging.INFO, logger="autospec.controller"):
        for _ in range(2):
            out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                do_sample=False, return_dict_in_generate=True)
    assert _cache(out) is None and out.sequences.shape == (2, 18)
    notes = [r.getMessage() for r in caplog.records if "carries no cache" in r.getMessage()]
    assert len(notes) == 1 and "batch > 1" in notes[0]
