"""Which attention layouts the exactness claim covers (``checks.attention_layout``).

Sliding windows shorter than the sequence — every layer (Mistral-style), or alternating with
full layers (Qwen2 with ``use_sliding_window``, Gemma-2-style) — are served, token-identical
to ``generate`` at batch 1 and at B > 1 with left padding. Layers the engine cannot roll back
(recurrent, linear attention) go to the original ``generate`` with the reason logged. The
models are tiny and random; each test first checks that its window changes the output, so a
loop that ignored the window would fail here.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import autospec
from autospec.engine.checks import attention_layout

from conftest import noisy_copy, tiny

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              pad_token_id=0, bos_token_id=1, eos_token_id=3, tie_word_embeddings=False)
LAYOUTS = {
    # every layer slides over 6 tokens
    "mistral": (MistralForCausalLM, lambda w: MistralConfig(sliding_window=w, **COMMON)),
    # a full layer, then a sliding one
    "qwen2": (Qwen2ForCausalLM, lambda w: Qwen2Config(
        use_sliding_window=w is not None, max_window_layers=1, sliding_window=w, **COMMON)),
    # sliding and full layers alternating (Gemma-2: eager attention, logit soft-capping)
    "gemma2": (Gemma2ForCausalLM, lambda w: Gemma2Config(
        sliding_window=w, head_dim=16, query_pre_attn_scalar=16,
        **{**COMMON, "num_hidden_layers": 4})),
}
WINDOW = 6
NEW = 30


def build(kind: str, attention: str, window: int = WINDOW):
    cls, config = LAYOUTS[kind]
    cfg = config(window)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.generation_config.pad_token_id = 0
    return model


def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, 97, (rows, 12), generator=torch.Generator().manual_seed(rows))
    mask = torch.ones_like(ids)
    if rows > 1:  # a left-padded row
        ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


CASES = [(kind, attention) for kind in LAYOUTS
         for attention in (("eager",) if kind == "gemma2" else ("sdpa", "eager"))]


@pytest.mark.parametrize("kind,attention", CASES)
def test_sliding_windows_are_served_exactly(kind, attention):
    target = build(kind, attention)
    layout = attention_layout(target)
    assert layout.sliding and layout.problem is None and layout.window == WINDOW
    # the window matters: with one longer than the sequence the same weights continue
    # differently
    ids, mask = batch(1)
    windowless = build(kind, attention, window=10_000)
    kw = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=None)
    assert not torch.equal(windowless.generate(ids, attention_mask=mask, **kw),
                           target.generate(ids, attention_mask=mask, **kw))
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False)
    for rows, k in ((1, 3), (3, 1), (3, 3)):
        ids, mask = batch(rows)
        ref = target.generate(ids, attention_mask=mask, **kw)
        out = spec.generate(ids, attention_mask=mask, k=k, **kw)
        assert torch.equal(out, ref), (rows, k)
        assert not spec.fallbacks
        assert spec.last_stats.drafted > 0 and spec.last_stats.accepted > 0
    spec.close()


def test_layers_the_engine_cannot_roll_back_go_to_generate_with_a_reason(caplog):
    cfg = MambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=4,
                      pad_token_id=0, eos_token_id=3, bos_token_id=1)
    torch.manual_seed(0)
    model = MambaForCausalLM(cfg).eval()
    layout = attention_layout(model)
    assert layout.problem is not None and "linear_attention" in layout.problem
    ids = torch.randint(4, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=None)
    spec = autospec.Controller(model, store=False)  # prompt lookup alone: no draft needed
    with caplog.at_level(logging.INFO, logger="autospec.controller"):
        out = spec.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(out, ref)
    assert spec.fallbacks == {layout.problem: 1}
    assert layout.problem in caplog.text
    spec.close()


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=3))


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=97, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=3, decoder_start_token_id=2, forced_eos_token_id=None))


@pytest.mark.parametrize("build_model", [_t5, _bart], ids=["t5", "bart"])
def test_an_encoder_decoder_target_is_wrapped_and_served_by_its_own_generate(
        build_model, tmp_path, caplog):
    torch.manual_seed(0)
    model = build_model().eval()
    ids = torch.randint(4, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, do_sample=False, max_new_tokens=6)
    spec = autospec.wrap(model, store=f"sqlite:///{tmp_path / 'a.db'}")  # no refusal at wrap
    try:
        with caplog.at_level(logging.INFO, logger="autospec.controller"):
            first = model.generate(ids, do_sample=False, max_new_tokens=6)
            again = model.generate(ids[:1], do_sample=False, max_new_tokens=6)
    finally:
        autospec.unwrap(model)
    assert torch.equal(first, ref) and torch.equal(again, ref[:1])
    (reason,) = spec.fallbacks
    assert "is an encoder-decoder model" in reason and spec.fallbacks[reason] == 2
    assert caplog.text.count(reason) == 1  # logged once for the kind of request


def test_an_encoder_decoder_draft_is_refused_at_wrap():
    with pytest.raises(autospec.PairMismatchError, match="the draft is an encoder-decoder"):
        autospec.Controller(tiny(), _t5(), store=False)


def test_only_masking_kernels_serve_sliding_windows_at_batch():
    layout = attention_layout(build("mistral", "sdpa"))
    assert layout.batch_problem() is None
    other = type(layout)(kinds=layout.kinds, window=layout.window, attention="flash_attention_2")
    assert "sliding-window attention at batch > 1" in other.batch_problem()
