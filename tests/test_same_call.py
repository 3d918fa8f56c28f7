"""Same call, same result: whatever ``generate`` accepts, the wrapped model returns the same
way (token for token when greedy), and whatever ``generate`` refuses, the wrapped model
refuses with the same exception."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import autospec

from conftest import noisy_copy, prompt, tiny

IDS = prompt(10, seed=7)


@pytest.fixture(scope="module")
def models():
    target = tiny(sharpen=30.0)
    return target, noisy_copy(target, 0.5)


def _run(model, args, kwargs):
    torch.manual_seed(0)
    try:
        out = model.generate(*args, **kwargs)
    except Exception as e:  # what generate refuses, as (type, message)
        return type(e), str(e)
    return out.dtype, out.tolist()


# the call → whether the loop must serve it (True) or generate serves/refuses it (False)
SERVED = [
    ("float max_new_tokens", {"max_new_tokens": 3.0}, True),
    ("fractional max_new_tokens", {"max_new_tokens": 2.5}, True),
    ("default length (20 new tokens)", {}, True),
    ("fractional max_length", {"max_length": 13.5}, True),
    ("top_p=0 is greedy", {"do_sample": True, "top_p": 0.0, "max_new_tokens": 6}, True),
    ("int32 ids", {"input_ids": IDS.int(), "max_new_tokens": 4}, True),
]
REFUSED = [
    ("float input_ids", {"input_ids": IDS.float(), "max_new_tokens": 4}),
    ("inputs and input_ids", {"inputs": IDS, "input_ids": IDS, "max_new_tokens": 4}),
    ("wrong-shape attention_mask", {"attention_mask": torch.tensor([[0, 1, 1]]),
                                    "max_new_tokens": 4}),
    ("fractional min_new_tokens", {"min_new_tokens": 2.5, "max_new_tokens": 4}),
    ("fractional top_k", {"do_sample": True, "top_k": 2.5, "max_new_tokens": 4}),
    ("negative top_k", {"do_sample": True, "top_k": -1, "max_new_tokens": 4}),
    ("zero temperature", {"do_sample": True, "temperature": 0.0, "max_new_tokens": 4}),
    ("negative top_p", {"do_sample": True, "top_p": -0.5, "max_new_tokens": 4}),
    ("min_p above 1", {"do_sample": True, "min_p": 2.0, "max_new_tokens": 4}),
    ("zero repetition_penalty", {"repetition_penalty": 0.0, "max_new_tokens": 4}),
    ("max_new_tokens as text", {"max_new_tokens": "4"}),
    ("max_new_tokens 0", {"max_new_tokens": 0}),
]


def _call(case: dict):
    kwargs = dict(case)
    if "inputs" in kwargs:
        return (kwargs.pop("inputs"),), kwargs
    if "input_ids" in kwargs:
        return (kwargs.pop("input_ids"),), kwargs
    return (IDS,), kwargs


@pytest.mark.parametrize("name,case,loop", SERVED, ids=[c[0] for c in SERVED])
def test_accepted_calls_return_what_generate_returns(models, name, case, loop):
    target, draft = models
    args, kwargs = _call(case)
    ref = _run(target, args, kwargs)
    assert ref[0] is torch.int64, ref  # generate serves it
    ctrl = autospec.wrap(target, draft, store=False, policy=3)
    try:
        got = _run(target, args, kwargs)
        assert got == ref
        assert (ctrl.last_stats is not None) == loop, ctrl.fallbacks
    finally:
        autospec.unwrap(target)


@pytest.mark.parametrize("name,case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_calls_raise_what_generate_raises(models, name, case):
    target, draft = models
    args, kwargs = _call(case)
    ref = _run(target, args, kwargs)
    assert isinstance(ref[0], type) and issubclass(ref[0], Exception), ref
    autospec.wrap(target, draft, store=False, policy=3)
    try:
        assert _run(target, args, kwargs) == ref
    finally:
        autospec.unwrap(target)


def test_min_new_tokens_wins_over_min_length_as_in_generate(models):
    """generate bans EOS for min_new_tokens new tokens and then ignores min_length: with
    min_new_tokens=2, min_length=40 the EOS the target emits third ends the output."""
    target, draft = models
    plain = target.generate(IDS, max_new_tokens=8, eos_token_id=None)
    eos = int(plain[0, IDS.shape[1] + 2])
    assert eos not in plain[0, IDS.shape[1]: IDS.shape[1] + 2].tolist()
    kwargs = dict(max_new_tokens=8, eos_token_id=eos, min_new_tokens=2, min_length=40)
    ref = target.generate(IDS, **kwargs)
    assert ref.shape[1] == IDS.shape[1] + 3  # stopped at that EOS
    ctrl = autospec.wrap(target, draft, store=False, policy=3)
    try:
        assert torch.equal(target.generate(IDS, **kwargs), ref)
        assert ctrl.last_stats is not None
    finally:
        autospec.unwrap(target)


@pytest.mark.parametrize("k_max,error", [(2.5, TypeError), ("4", TypeError), (True, TypeError),
                                         (None, TypeError), (0, ValueError), (65, ValueError)])
def test_k_max_is_checked_with_a_clear_error(models, k_max, error):
    target, draft = models
    with pytest.raises(error, match="k_max"):
        autospec.wrap(target, draft, store=False, k_max=k_max)
    assert getattr(target, "_autospec_controller", None) is None


@pytest.mark.parametrize("k", [2.5, "2", True])
def test_k_is_checked_with_a_clear_error(models, k):
    target, draft = models
    autospec.wrap(target, draft, store=False)
    try:
        with pytest.raises(TypeError, match="whole number"):
            target.generate(IDS, max_new_tokens=3, k=k)
    finally:
        autospec.unwrap(target)


def test_wrap_without_a_model_says_what_it_needs(models):
    target, draft = models
    with pytest.raises(TypeError, match="the draft must be a transformers causal LM"):
        autospec.wrap(target, "Qwen/Qwen2.5-0.5B")  # a name is not a model (None: no draft)
    with pytest.raises(TypeError, match="the target must be a transformers causal LM"):
        autospec.wrap(None, draft)
    assert getattr(target, "_autospec_controller", None) is None


def test_deepcopy_of_a_wrapped_model_is_an_unwrapped_copy(models):
    target, draft = models
    ref = target.generate(IDS, max_new_tokens=8)
    ctrl = autospec.wrap(target, draft, store=False, policy=3)
    try:
        twin = copy.deepcopy(target)
        assert getattr(twin, "_autospec_controller", None) is None
        assert "generate" not in vars(twin)  # the class's own generate
        assert twin.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()
        assert torch.equal(twin.generate(IDS, max_new_tokens=8), ref)
        # the original is untouched and still speculative
        assert torch.equal(target.generate(IDS, max_new_tokens=8), ref)
        assert ctrl.last_stats is not None and ctrl.last_stats.drafted > 0
        twin_ctrl = autospec.wrap(twin, draft, store=False, policy=3)  # the copy wraps too
        assert torch.equal(twin.generate(IDS, max_new_tokens=8), ref)
        assert twin_ctrl.last_stats.drafted > 0
        autospec.unwrap(twin)
    finally:
        autospec.unwrap(target)


def test_pickling_a_wrapped_model_says_to_unwrap_first(models):
    target, draft = models
    autospec.wrap(target, draft, store=False)
    try:
        with pytest.raises(TypeError, match=r"autospec\.unwrap"):
            pickle.dumps(target)
    finally:
        autospec.unwrap(target)
    back = pickle.loads(pickle.dumps(target))  # unwrapped: an ordinary model again
    assert torch.equal(back.generate(IDS, max_new_tokens=4), target.generate(IDS, max_new_tokens=4))
