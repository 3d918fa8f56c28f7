"""The calls transformers' own generation tests make, against the unwrapped ``generate``, on
four architectures: each call either served by autospec with generate's output token for token
(sequences, and scores and logits where asked for), or handed to the original ``generate`` with
a named reason. At least half of them are served. Sampled calls use ``top_k=1`` so that sampling
is deterministic and comparable token for token (its law is tested in test_sampled_exact.py and
test_processors.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
)

import autospec

from conftest import EOS, VOCAB, noisy_copy, prompt, tiny_tokenizer

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": 8,
                                                 "final_logit_softcapping": 30.0}),
}


def build(arch: str, seed: int = 0):
    cfg_cls, model_cls, extra = ARCHS[arch]
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
                  **extra)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.generation_config.pad_token_id = 0
    return model


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.length,
                          dtype=torch.bool)


IDS = prompt(10, seed=5)
HOLE = torch.ones_like(IDS)
HOLE[0, 2] = HOLE[0, 6] = 0
LEFT = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], 1)
BATCH = torch.cat([IDS, prompt(10, seed=6)])
BATCH_MASK = torch.cat([LEFT, torch.ones_like(LEFT)])
SAMPLE = dict(do_sample=True, top_k=1)  # deterministic sampling: comparable token for token

# name → (generate's keyword arguments, None: served | a part of the fallback reason)
CALLS = {
    "greedy": (dict(), None),
    "sample": (SAMPLE, None),
    "sample, temperature and top-p": (SAMPLE | dict(temperature=0.7, top_p=0.9), None),
    "greedy, bad words": (dict(bad_words_ids=[[20], [30, 31]]), None),
    "sample, bad words": (SAMPLE | dict(bad_words_ids=[[20], [30, 31]]), None),
    "remove_invalid_values": (dict(remove_invalid_values=True), None),
    "custom stopping criteria": (dict(stopping_criteria=StoppingCriteriaList(
        [StopAtLength(17)])), None),
    "output_scores": (dict(output_scores=True, return_dict_in_generate=True), None),
    "output_logits": (dict(output_logits=True, return_dict_in_generate=True), None),
    "scores and logits, sampled": (SAMPLE | dict(output_scores=True, output_logits=True,
                                                 return_dict_in_generate=True), None),
    "a mask with a hole": (dict(attention_mask=HOLE), None),
    "a left-padded row": (dict(attention_mask=LEFT), None),
    "a left-padded batch": (dict(input_ids=BATCH, attention_mask=BATCH_MASK), None),
    "EOS as int": (dict(eos_token_id=EOS), None),
    "EOS as list": (dict(eos_token_id=[EOS, 40, 41]), None),
    "min_new_tokens": (dict(eos_token_id=[EOS, 40], min_new_tokens=5), None),
    "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), None),
    "repetition_penalty": (dict(repetition_penalty=1.3), None),
    "sequence_bias": (dict(sequence_bias={(20,): 5.0}), None),
    "suppress_tokens": (dict(suppress_tokens=[20, 21], begin_suppress_tokens=[22]), None),
    "forced_eos_token_id": (dict(forced_eos_token_id=EOS), None),
    "exponential_decay_length_penalty": (dict(exponential_decay_length_penalty=(4, 1.2),
                                              eos_token_id=EOS), None),
    "typical_p and epsilon": (SAMPLE | dict(typical_p=0.9, epsilon_cutoff=3e-4), None),
    "prefix_allowed_tokens_fn": (dict(prefix_allowed_tokens_fn=lambda b, s: list(range(
        4, 60))), None),
    "stop_strings": (dict(stop_strings=["w20"]), None),
    "use_cache=False": (dict(use_cache=False), None),
    "return_dict_in_generate": (dict(return_dict_in_generate=True), None),
    "beam search": (dict(num_beams=2), "num_beams"),
    "num_return_sequences": (SAMPLE | dict(num_return_sequences=2), "num_return_sequences"),
    "output_attentions": (dict(output_attentions=True, return_dict_in_generate=True),
                          "output_attentions"),
    "output_hidden_states": (dict(output_hidden_states=True, return_dict_in_generate=True),
                             "output_hidden_states"),
    "classifier-free guidance": (dict(guidance_scale=1.5), "guidance_scale"),
    "inputs_embeds": ("embeds", None),
    "inputs_embeds, a soft prompt": ("soft", "soft prompt"),
    "assistant_model": ("assistant", "assistant_model"),
}


def _call(fn, target, draft, kwargs):
    if kwargs in ("embeds", "soft"):
        with torch.no_grad():
            embeds = target.get_input_embeddings()(IDS)
        if kwargs == "soft":
            embeds = embeds + 0.01
        return fn(inputs_embeds=embeds, max_new_tokens=12, pad_token_id=0)
    if kwargs == "assistant":
        return fn(IDS, assistant_model=draft, max_new_tokens=12, pad_token_id=0)
    kw = dict(max_new_tokens=12, pad_token_id=0) | dict(kwargs)
    ids = kw.pop("input_ids", IDS)
    return fn(ids, tokenizer=tiny_tokenizer(), **kw) if "stop_strings" in kw else fn(ids, **kw)


def _same(out, ref) -> None:
    if isinstance(ref, torch.Tensor):
        assert torch.equal(out, ref)
        return
    assert torch.equal(out.sequences, ref.sequences)
    for name in ("scores", "logits"):
        mine, theirs = getattr(out, name, None), getattr(ref, name, None)
        assert (mine is None) == (theirs is None), name
        for a, b in zip(mine or (), theirs or (), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.isinf(), b.isinf())


@pytest.mark.parametrize("arch", ARCHS)
def test_generations_tests_calls_are_served_identically_or_named(arch):
    target = build(arch)
    draft = noisy_copy(target, 0.5)
    spec = autospec.Controller(target, draft, store=False, policy="fixed:3")
    served = []
    for name, (kwargs, reason) in CALLS.items():
        if name == "a mask with a hole" and arch in ("mistral", "gemma2"):
            reason = "sliding-window"  # the window counts the masked tokens: generate serves
        torch.manual_seed(0)
        ref = _call(target.generate, target, draft, kwargs)
        torch.manual_seed(0)
        before = dict(spec.fallbacks)
        out = _call(spec.generate, target, draft, kwargs)
        _same(out, ref)
        if reason is None:
            assert spec.last_stats is not None, (name, spec.fallbacks)
            served.append(name)
        else:
            new = [r for r in spec.fallbacks if spec.fallbacks[r] > before.get(r, 0)]
            assert spec.last_stats is None and any(reason in r for r in new), (name, new)
    assert len(served) >= len(CALLS) / 2


def test_an_embedded_prompt_is_served_as_its_tokens_with_generates_view():
    """inputs_embeds alone: the output is the new tokens alone, processors and criteria see
    only those (a repetition penalty does not count the prompt), and the returned cache holds
    the prompt's positions as generate's does."""
    target = build("llama")
    spec = autospec.Controller(target, noisy_copy(target, 0.5), store=False, policy="fixed:3")
    with torch.no_grad():
        embeds = target.get_input_embeddings()(IDS)
    for kw in (dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2),
               dict(min_new_tokens=4, eos_token_id=[EOS, 40]), dict(max_length=15),
               dict(return_dict_in_generate=True, output_scores=True)):
        kw = dict(do_sample=False, pad_token_id=0) | (
            {} if "max_length" in kw else dict(max_new_tokens=12)) | kw
        ref = target.generate(inputs_embeds=embeds, **kw)
        out = spec.generate(inputs_embeds=embeds, **kw)
        assert spec.last_stats is not None, (kw, spec.fallbacks)
        _same(out, ref)
        if "return_dict_in_generate" in kw:
            assert (out.past_key_values.get_seq_length()
                    == ref.past_key_values.get_seq_length() == IDS.shape[1] + 11)
    # the same prompt's ids give the same tokens after the prompt
    plain = spec.generate(IDS, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(spec.generate(inputs_embeds=embeds, max_new_tokens=12, do_sample=False,
                                     pad_token_id=0), plain[:, IDS.shape[1]:])
