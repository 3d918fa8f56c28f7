"""wrap/unwrap, the generate contract (arguments, return types, fallbacks) and bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, TextIteratorStreamer, pipeline

import autospec
from autospec.engine.checks import PairMismatchError

from conftest import noisy_copy, prompt, tiny, tiny_tokenizer


@pytest.fixture
def models():
    target = tiny("llama", sharpen=30.0)
    return target, noisy_copy(target, 0.2)


def test_wrap_makes_generate_speculative_and_unwrap_restores_it(models):
    target, draft = models
    original = type(target).generate
    spec = autospec.wrap(target, draft)
    ids = prompt()
    out = target.generate(ids, max_new_tokens=15, do_sample=False)
    assert spec.last_stats is not None and spec.last_stats.new_tokens == out.shape[1] - 10
    assert autospec.unwrap(target) is target
    assert target.generate.__func__ is original
    assert torch.equal(target.generate(ids, max_new_tokens=15, do_sample=False), out)
    with pytest.raises(ValueError, match="not wrapped"):
        autospec.unwrap(target)


def test_wrapping_twice_is_an_error(models):
    target, draft = models
    autospec.wrap(target, draft)
    with pytest.raises(ValueError, match="already wrapped"):
        autospec.wrap(target, draft)
    autospec.unwrap(target)


def test_text_generation_pipeline_runs_speculatively(models):
    target, draft = models
    tok = tiny_tokenizer()
    plain = pipeline("text-generation", model=target, tokenizer=tok)(
        "w5 w6 w7", max_new_tokens=10, do_sample=False)
    spec = autospec.wrap(target, draft, tokenizer=tok, draft_tokenizer=tiny_tokenizer(), policy=4)
    out = pipeline("text-generation", model=target, tokenizer=tok)(
        "w5 w6 w7", max_new_tokens=10, do_sample=False)
    autospec.unwrap(target)
    assert out == plain
    assert spec.last_stats.drafted > 0 and not spec.fallbacks


def test_return_dict_with_scores_and_logits_matches_generate(models):
    target, draft = models
    spec = autospec.Controller(target, draft)
    ids = prompt()
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
              output_scores=True, output_logits=True, repetition_penalty=1.2)
    ref = target.generate(ids, **kw)
    out = spec.generate(ids, k=3, **kw)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_generation_config_object_and_model_defaults_are_honoured(models):
    target, draft = models
    spec = autospec.Controller(target, draft)
    ids = prompt()
    gc = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=None)
    assert torch.equal(spec.generate(ids, generation_config=gc), target.generate(ids, generation_config=gc))
    target.generation_config.max_new_tokens = 7  # the model's own default, as generate reads it
    assert spec.generate(ids, do_sample=False, eos_token_id=None).shape[1] == 17
    target.generation_config.max_new_tokens = None


def test_left_padding_at_batch_one(models):
    target, draft = models
    spec = autospec.Controller(target, draft)
    ids = prompt()
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    ref = target.generate(padded, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = spec.generate(padded, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref) and not spec.fallbacks


def test_streamer_receives_the_prompt_then_every_token(models):
    target, draft = models
    tok = tiny_tokenizer()
    spec = autospec.Controller(target, draft, tokenizer=tok)
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    ids = prompt()
    out = spec.generate(ids, max_new_tokens=12, do_sample=False, streamer=streamer, k=4)
    text = "".join(streamer)
    assert text.split() == tok.decode(out[0, 10:]).split()


def test_stop_strings_and_stopping_criteria_stop_where_generate_does(models):
    target, draft = models
    tok = tiny_tokenizer()
    spec = autospec.Controller(target, target, tokenizer=tok)  # all accepted: long blocks
    ids = prompt()
    free = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    stop = tok.decode(free[0, 16:17])  # a word from mid-output
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, stop_strings=[stop],
              tokenizer=tok)
    ref = target.generate(ids, **kw)
    assert ref.shape[1] < free.shape[1]
    assert torch.equal(spec.generate(ids, k=8, **kw), ref)

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([input_ids.shape[1] >= 15])

    ref = target.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=[StopAfter()])
    out = spec.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=[StopAfter()], k=8)
    assert torch.equal(out, ref) and out.shape[1] == 15


@pytest.mark.parametrize("kwargs,reason", [
    (dict(num_beams=2), "num_beams"),
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(encoder_no_repeat_ngram_size=2), "encoder_no_repeat_ngram_size"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
])
def test_unsupported_requests_go_to_the_original_generate(models, caplog, kwargs, reason):
    target, draft = models
    spec = autospec.Controller(target, draft)
    ids = prompt()

    def both(fn):  # the original's result, or the original's own error (contrastive search
        torch.manual_seed(0)  # now lives on the Hub, which generate refuses to fetch here)
        try:
            return fn(ids, max_new_tokens=8, **kwargs)
        except ValueError as e:
            return str(e)

    ref = both(target.generate)
    with caplog.at_level(logging.INFO, logger="autospec"):
        out = both(spec.generate)
        both(spec.generate)
    assert torch.equal(out, ref) if isinstance(ref, torch.Tensor) else out == ref
    assert [r for r in caplog.records if reason in r.getMessage()].__len__() == 1  # said once
    assert sum(spec.fallbacks.values()) == 2 and spec.last_stats is None


def test_batch_larger_than_one_runs_speculatively_and_exactly(models):
    # (batched generate in depth: tests/test_batch_exact.py)
    target, draft = models
    spec = autospec.Controller(target, draft)
    ids = torch.cat([prompt(seed=1), prompt(seed=2)])
    out = spec.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=6, do_sample=False))
    assert not spec.fallbacks and spec.last_stats.batch_size == 2


# -- bad input: clear errors before any work ------------------------------------------------

def test_different_tokenizers_are_refused():
    target = tiny("llama")
    other = tiny_tokenizer()
    other.add_tokens(["zz"])
    with pytest.raises(PairMismatchError, match="tokenizers differ"):
        autospec.wrap(target, tiny("llama", seed=2), tokenizer=tiny_tokenizer(), draft_tokenizer=other)
    assert "generate" not in vars(target)


def test_same_vocab_size_different_token_ids_are_refused():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    vocab = b.get_vocab()
    swapped = {**vocab, "w5": vocab["w6"], "w6": vocab["w5"]}
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    b = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(swapped, unk_token="<unk>")),
                                pad_token="<pad>", bos_token="<s>", unk_token="<unk>", eos_token="</s>")
    assert len(a) == len(b)
    with pytest.raises(PairMismatchError, match="different ids"):
        autospec.Controller(tiny("llama"), tiny("llama", seed=2), tokenizer=a, draft_tokenizer=b)


def test_vocab_size_mismatch_without_tokenizers_is_refused():
    with pytest.raises(PairMismatchError, match="vocabulary sizes differ"):
        autospec.Controller(tiny("llama", vocab=97), tiny("llama", vocab=120))


@pytest.mark.parametrize("k", [-1, 17, 1000])
def test_k_out_of_range_is_refused(models, k):
    spec = autospec.Controller(*models)
    with pytest.raises(ValueError, match=r"k must be in 0\.\.16"):
        spec.generate(prompt(), max_new_tokens=4, k=k)


def test_k_max_beyond_the_limit_is_refused(models):
    with pytest.raises(ValueError, match="k_max"):
        autospec.Controller(*models, k_max=10_000)


def test_prompt_longer_than_the_context_is_refused():
    target = tiny("llama", max_pos=32)
    spec = autospec.Controller(target, noisy_copy(target, 0.1))
    with pytest.raises(ValueError, match="does not fit the target's context of 32"):
        spec.generate(prompt(40), max_new_tokens=4)


def test_dtype_mismatch_moves_the_draft_or_is_refused(models, caplog):
    target, _ = models
    draft = noisy_copy(target, 0.1).to(torch.bfloat16)
    with pytest.raises(PairMismatchError, match="draft on cpu as torch.bfloat16"):
        autospec.Controller(target, draft, match_draft=False)
    with caplog.at_level(logging.WARNING, logger="autospec"):
        autospec.Controller(target, draft)
    assert next(draft.parameters()).dtype == torch.float32
    assert any("moving the draft" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("category", ["", "   ", None, 5])
def test_empty_or_non_string_category_is_refused(models, category):
    spec = autospec.Controller(*models)
    if category is None:  # None means "the controller's default"
        spec.generate(prompt(), max_new_tokens=2, category=category)
        return
    with pytest.raises(ValueError, match="category"):
        spec.generate(prompt(), max_new_tokens=2, category=category)


def test_unknown_policy_name_is_refused(models):
    with pytest.raises(ValueError, match="unknown policy"):
        autospec.Controller(*models, policy="fastest")


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=-0.5)])
def test_invalid_sampling_settings_are_refused_like_generate(models, bad):
    target, draft = models
    spec = autospec.Controller(target, draft)
    with pytest.raises(ValueError) as theirs:
        target.generate(prompt(), max_new_tokens=2, do_sample=True, **bad)
    with pytest.raises(ValueError) as ours:  # generate's own check, word for word
        spec.generate(prompt(), max_new_tokens=2, do_sample=True, **bad)
    assert str(ours.value) == str(theirs.value)
