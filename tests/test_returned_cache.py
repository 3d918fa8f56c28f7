"""``return_dict_in_generate=True`` returns the cache ``generate`` returns, or the call goes to
``generate``: never another object.

At batch 1 without padding on the eager path the output carries the engine's own target
cache, cropped to every token but the last. Everywhere else generate's cache is built from
the returned sequences by one forward (a batch's finished rows left the engine's cache early;
padding; a static cache reused by the next request; sliding-window layers kept whole by the
engine). ``use_cache=False`` returns none; a ``cache_implementation`` other than the dynamic
cache goes to ``generate``, which returns that cache.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache, StaticCache

import autospec

from conftest import EOS, noisy_copy, prompt, tiny
from test_attention_layouts import build as sliding_model


def _cache(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _same_cache(mine, theirs, length: int) -> None:
    assert type(mine) is type(theirs)
    assert mine.get_seq_length() == theirs.get_seq_length() == length
    assert len(mine.layers) == len(theirs.layers)
    for a, b in zip(mine.layers, theirs.layers):
        assert type(a) is type(b)
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)


def _left_padded(rows: int, seed: int = 0):
    ids = torch.cat([prompt(10, seed=seed + s) for s in range(rows)])
    mask = torch.ones_like(ids)
    ids[-1, :4], mask[-1, :4] = 0, 0
    return ids, mask


def test_batch_one_returns_the_targets_cache_as_generate_does():
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    ids = prompt(10)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
              return_dict_in_generate=True, eos_token_id=None)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, k=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    _same_cache(_cache(out), _cache(ref), ref.sequences.shape[1] - 1)


@pytest.mark.parametrize("eos", [None, EOS])
def test_a_batch_returns_generates_cache(eos):
    """Finished rows included: generate fed them padding (with an EOS id) or their own
    tokens (without) after they stopped, and its cache holds those."""
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    ids, mask = _left_padded(3)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False,
              return_dict_in_generate=True, eos_token_id=eos)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, k=4, **kw)
    assert spec.last_stats is not None  # served by the loop
    assert torch.equal(out.sequences, ref.sequences)
    _same_cache(_cache(out), _cache(ref), ref.sequences.shape[1] - 1)


def test_a_left_padded_row_returns_generates_cache():
    target = tiny("qwen2", sharpen=30.0)
    spec = autospec.Controller(target, None, store=False)
    ids, mask = _left_padded(1)
    ids, mask = ids[-1:], mask[-1:]
    kw = dict(attention_mask=mask, max_new_tokens=9, do_sample=False,
              return_dict_in_generate=True, eos_token_id=None)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, k=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    _same_cache(_cache(out), _cache(ref), ref.sequences.shape[1] - 1)


def test_a_static_cache_controller_returns_generates_dynamic_cache():
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False, static_cache=True)
    ids = prompt(10)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=15, do_sample=False,
              return_dict_in_generate=True, eos_token_id=None)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, k=3, **kw)
    assert spec.last_stats.path.startswith("static")
    assert torch.equal(out.sequences, ref.sequences)
    _same_cache(_cache(out), _cache(ref), ref.sequences.shape[1] - 1)


def test_sliding_window_layers_return_generates_cache():
    model = sliding_model("mistral", "sdpa")
    spec = autospec.Controller(model, noisy_copy(model, 0.3), store=False)
    ids = prompt(12)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
              return_dict_in_generate=True, eos_token_id=None)
    ref = model.generate(ids, **kw)
    out = spec.generate(ids, k=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    mine, theirs = _cache(out), _cache(ref)
    assert [type(layer) for layer in mine.layers] == [type(layer) for layer in theirs.layers]
    for a, b in zip(mine.layers, theirs.layers):  # a sliding layer holds its window alone
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)


def test_use_cache_false_returns_no_cache():
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    for ids, mask in (_left_padded(1), _left_padded(2)):
        kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=False,
                  return_dict_in_generate=True, eos_token_id=None)
        ref = target.generate(ids, **kw)
        out = spec.generate(ids, k=3, **kw)
        assert spec.last_stats is not None
        assert torch.equal(out.sequences, ref.sequences)
        assert _cache(ref) is None and _cache(out) is None


def test_a_static_cache_implementation_goes_to_generate(caplog):
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    ids = prompt(10)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
              eos_token_id=None, cache_implementation="static")
    with caplog.at_level(logging.INFO, logger="autospec.controller"):
        out = spec.generate(ids, return_dict_in_generate=True, **kw)
    assert spec.last_stats is None and isinstance(_cache(out), StaticCache)
    assert any("cache_implementation='static'" in r.getMessage() for r in caplog.records)
    # without the output dict the cache is not returned: the loop serves it
    spec.generate(ids, **kw)
    assert spec.last_stats is not None


def test_the_returned_cache_continues_as_generates_does():
    """A caller who continues from the returned cache gets what continuing from generate's
    would give."""
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, None, store=False)
    ids, mask = _left_padded(2, seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False,
              return_dict_in_generate=True, eos_token_id=None)
    out = spec.generate(ids, k=3, **kw)
    cache = _cache(out)
    assert isinstance(cache, DynamicCache)
    seq = out.sequences
    full = torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    pos = (full.cumsum(-1) - 1).masked_fill(full == 0, 0)
    with torch.no_grad():
        step = target(seq[:, -1:], attention_mask=full, position_ids=pos[:, -1:],
                      past_key_values=cache, use_cache=True).logits[:, -1]
        whole = target(seq, attention_mask=full, position_ids=pos).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-4)
