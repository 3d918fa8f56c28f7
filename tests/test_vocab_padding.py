"""Target and draft whose vocabularies differ in padding rows (Qwen2.5-0.5B has 151936 rows,
Qwen2.5-7B 152064): the pair passes ``wrap`` with a tokenizer that fits both, and every
request must then be served exactly, whichever model has the extra rows and whatever ids the
models emit there."""

from __future__ import annotations

import copy

import pytest
import torch

import autospec

from conftest import VOCAB, noisy_copy, prompt, tiny, tiny_tokenizer

EXTRA = 16
BIG = VOCAB + EXTRA


def _pad_rows(model, rows: int, seed: int, scale: float = 1.0):
    """``model`` grown to ``rows`` embedding and head rows; the new head rows are random with
    the spread of the existing ones times ``scale`` (so the model does emit those ids)."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    old = model.get_output_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows, mean_resizing=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[old:] = torch.randn(rows - old, head.shape[1], generator=g) * head[:old].std() * scale
        emb = model.get_input_embeddings().weight
        emb[old:] = torch.randn(rows - old, emb.shape[1], generator=g) * emb[:old].std()
    return model


def _pair(direction: str):
    base = tiny("llama", seed=0, sharpen=30.0)
    draft = noisy_copy(base, 0.3)
    if direction == "target-larger":
        return _pad_rows(base, BIG, seed=5), draft
    # the draft's padding rows score high: left alone, it would propose ids the target lacks
    return base, _pad_rows(draft, BIG, seed=6, scale=1.5)


def _prompts(n: int) -> list[torch.Tensor]:
    return [prompt(6 + 3 * i, seed=40 + i) for i in range(n)]


def _left_pad(rows: list[torch.Tensor]):
    width = max(r.shape[1] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1]:] = r[0]
        mask[i, width - r.shape[1]:] = 1
    return ids, mask


@pytest.mark.parametrize("direction", ["target-larger", "draft-larger"])
@pytest.mark.parametrize("batch", [1, 3])
def test_padded_vocab_greedy_equals_generate(direction, batch):
    target, draft = _pair(direction)
    ids, mask = _left_pad(_prompts(batch))
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    ref = target.generate(ids, **kw)
    new = ref[:, ids.shape[1]:]
    if direction == "target-larger":  # the case that crashed: the target emits ids ≥ VOCAB
        assert bool((new >= VOCAB).any()), "the test pair no longer emits padding ids"
    else:  # the draft, left alone, proposes ids the target cannot embed
        d_ref = draft.generate(ids, **kw)[:, ids.shape[1]:]
        assert bool((d_ref >= VOCAB).any()), "the test draft no longer emits padding ids"
    autospec.wrap(target, draft, tokenizer=tiny_tokenizer(), store=False)
    try:
        for k in (1, 3):
            out = target.generate(ids, k=k, **kw)
            assert torch.equal(out, ref), (direction, batch, k)
        stats = target._autospec_controller.last_stats
        assert stats is not None and stats.drafted > 0  # served by the loop, not a fallback
    finally:
        autospec.unwrap(target)


@pytest.mark.parametrize("direction", ["target-larger", "draft-larger"])
@pytest.mark.parametrize("batch", [1, 3])
def test_padded_vocab_sampled_runs(direction, batch):
    target, draft = _pair(direction)
    vt = target.get_output_embeddings().weight.shape[0]
    ids, mask = _left_pad(_prompts(batch))
    autospec.wrap(target, draft, tokenizer=tiny_tokenizer(), store=False)
    try:
        g = torch.Generator().manual_seed(0)
        seen_padding = False
        for _ in range(4):
            out = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=True,
                                  temperature=1.5, k=3, generator=g)
            new = out[:, ids.shape[1]:]
            assert out.shape[0] == batch and bool((new >= 0).all()) and bool((new < vt).all())
            seen_padding |= bool((new >= VOCAB).any())
            assert target._autospec_controller.last_stats.drafted > 0
        if direction == "target-larger":
            assert seen_padding, "no padding id was sampled: the test proves nothing"
    finally:
        autospec.unwrap(target)


def test_padded_vocab_sampled_law():
    """First generated token, drafted at k = 2 by a draft without the target's padding rows:
    its law is the target's p, padding ids included (the draft gives them q = 0, so only the
    residual can produce them)."""
    target, draft = _pair("target-larger")
    ids = prompt(8, seed=3)
    temperature = 2.0
    with torch.no_grad():
        p = (target(ids).logits[0, -1].float() / temperature).softmax(-1)
    p_pad = float(p[VOCAB:].sum())
    assert p_pad > 0.05, "the padding rows carry too little mass for the test to see them"
    autospec.wrap(target, draft, tokenizer=tiny_tokenizer(), store=False)
    try:
        g = torch.Generator().manual_seed(1)
        n = 600
        counts = torch.zeros(BIG)
        for _ in range(n):
            out = target.generate(ids, max_new_tokens=3, do_sample=True, temperature=temperature,
                                  k=2, generator=g)
            counts[out[0, ids.shape[1]]] += 1
    finally:
        autospec.unwrap(target)
    freq = counts / n
    sigma = (p_pad * (1 - p_pad) / n) ** 0.5
    assert abs(float(freq[VOCAB:].sum()) - p_pad) < 4 * sigma
    # total variation over the whole vocabulary, against its sampling noise at n draws
    assert 0.5 * float((freq - p).abs().sum()) < 0.12


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_padded_vocab_on_the_static_path(graphs):
    """The static runner (and its graph buffers) get the draft's ids mapped as well."""
    target, draft = _pair("target-larger")
    ids = _prompts(1)[0]
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert bool((ref[:, ids.shape[1]:] >= VOCAB).any())
    autospec.wrap(target, draft, tokenizer=tiny_tokenizer(), store=False, static_cache=True,
                  cuda_graphs=graphs)
    try:
        for _ in range(2):  # the second request reuses the runner
            assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False, k=3), ref)
        assert target._autospec_controller.last_stats.path.startswith("static")
    finally:
        autospec.unwrap(target)
