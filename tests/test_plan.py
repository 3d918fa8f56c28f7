"""The table of ``plan_request``: each ``generate`` argument → the plan field it sets, or the
reason the request goes to the original ``generate``. No forward runs: the mapping is pure."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
)

from autospec.engine.plan import Plan, plan_request

from conftest import prompt, tiny

IDS = prompt(10, seed=2)
LEFT = torch.tensor([[0, 0] + [1] * 8])
RIGHT = torch.tensor([[1] * 8 + [0, 0]])


@pytest.fixture(scope="module")
def model():
    return tiny()


def _field(plan: Plan, path: str):
    value = plan
    for part in path.split("."):
        value = getattr(value, part)
    return value


# call keyword arguments → (plan field, value it must hold)
FIELDS = [
    ({"max_new_tokens": 5}, "max_new_tokens", 5),
    ({"max_new_tokens": 2.5}, "max_new_tokens", 3),  # generate stops at length ≥ 12.5
    ({}, "max_new_tokens", 20),  # generate's default: 20 new tokens
    ({"max_length": 15}, "max_new_tokens", 5),
    ({"max_length": 15, "max_new_tokens": 7}, "max_new_tokens", 7),
    ({"min_new_tokens": 3, "max_new_tokens": 5}, "min_new_tokens", 3),
    ({"min_length": 13, "max_new_tokens": 5}, "min_new_tokens", 3),
    ({"min_new_tokens": 2, "min_length": 40, "max_new_tokens": 5}, "min_new_tokens", 2),
    ({"min_new_tokens": 3, "eos_token_id": None, "max_new_tokens": 5}, "min_new_tokens", 0),
    ({"eos_token_id": [3, 5], "max_new_tokens": 5}, "eos", (3, 5)),
    ({"eos_token_id": None, "max_new_tokens": 5}, "eos", ()),
    ({"do_sample": True, "temperature": 0.7}, "sampling.temperature", 0.7),
    ({"do_sample": False, "temperature": 0.7}, "sampling.temperature", 1.0),
    ({"do_sample": True, "top_k": 5}, "sampling.top_k", 5),
    ({"do_sample": True, "top_p": 0.0}, "sampling.top_p", 0.0),
    ({"do_sample": True, "top_p": 1.0}, "sampling.top_p", None),
    ({"do_sample": True, "min_p": 0.1}, "sampling.min_p", 0.1),
    ({"repetition_penalty": 1.2}, "sampling.repetition_penalty", 1.2),
    ({"return_dict_in_generate": True}, "return_dict", True),
    ({"output_scores": True}, "output_scores", True),
    ({"output_logits": True}, "output_logits", True),
    ({"attention_mask": LEFT}, "pad_prefix", IDS[:, :2]),
    ({"attention_mask": LEFT}, "input_ids", IDS[:, 2:]),
    ({"generation_config": GenerationConfig(max_new_tokens=4, do_sample=True, top_k=3)},
     "sampling.top_k", 3),
    ({"input_ids": IDS.int()}, "input_ids", IDS),
]

class Stateful(LogitsProcessor):
    """A caller's processor that does not say it depends on the prefix alone."""

    def __call__(self, input_ids, scores):
        return scores


# call keyword arguments → a part of the fallback reason
FALLBACKS = [
    ({"num_beams": 2}, "num_beams"),
    ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
    ({"encoder_no_repeat_ngram_size": 2}, "encoder_no_repeat_ngram_size"),
    ({"guidance_scale": 1.5}, "guidance_scale"),
    ({"logits_processor": LogitsProcessorList([Stateful()])},
     "logits processor Stateful is not known to depend on the prefix alone"),
    ({"synced_gpus": True}, "synced_gpus"),
    ({"inputs": IDS, "input_ids": IDS}, "both inputs and input_ids"),
    ({"input_ids": IDS.float()}, "dtype"),
    ({"input_ids": IDS[0]}, "2-D"),
    ({"attention_mask": torch.tensor([[0, 1, 1]])}, "attention_mask of another shape"),
    ({"attention_mask": RIGHT}, "right padding"),
    ({"attention_mask": torch.zeros_like(IDS)}, "attention_mask is all zeros (an empty prompt"),
    ({"max_length": 10}, "nothing to generate"),
    ({"stop_strings": ["w5"]}, "stop_strings without a tokenizer"),
    ({"foo": 1}, "model arguments ['foo']"),
    ({"args": (LogitsProcessorList(),)}, "positional arguments"),
]


def _plan(model, case: dict):
    kwargs = dict(case)
    args = kwargs.pop("args", ())
    gc = kwargs.pop("generation_config", None)
    inputs = kwargs.pop("inputs", None)
    if inputs is None and "input_ids" not in kwargs:
        inputs = IDS
    return plan_request(model, inputs, gc, args, kwargs, target_context=256)


@pytest.mark.parametrize("case,field,value", FIELDS, ids=[f"{c}->{f}" for c, f, _ in FIELDS])
def test_argument_sets_plan_field(model, case, field, value):
    plan, reason = _plan(model, case)
    assert plan is not None, reason
    got = _field(plan, field)
    if isinstance(value, torch.Tensor):
        assert torch.equal(got, value)
    else:
        assert got == value


@pytest.mark.parametrize("case,reason", FALLBACKS, ids=[r for _, r in FALLBACKS])
def test_argument_falls_back_with_reason(model, case, reason):
    plan, why = _plan(model, case)
    assert plan is None and reason in why, why


def test_batch_rows_and_padding(model):
    ids = torch.cat([IDS, prompt(10, seed=3)])
    mask = torch.cat([LEFT, torch.ones_like(LEFT)])
    plan, _ = plan_request(model, ids, None, (), {"attention_mask": mask, "max_new_tokens": 4})
    assert plan.batch == 2 and plan.pad_token_id == 0
    assert [r[0].shape[1] for r in plan.rows] == [8, 10]
    assert torch.equal(plan.padded, ids)


def test_a_prompt_past_the_context_is_an_error(model):
    with pytest.raises(ValueError, match="context"):
        plan_request(model, IDS, None, (), {"max_new_tokens": 4}, target_context=10)


def test_the_model_is_not_run_nor_changed(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gc_before = model.generation_config.to_dict()
    for case, _ in FALLBACKS:
        _plan(model, case)
    for case, _, _ in FIELDS:
        _plan(model, case)
    assert model.generation_config.to_dict() == gc_before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_batch_row_whose_mask_is_all_zeros_falls_back_as_an_empty_prompt(model):
    ids = torch.cat([IDS, prompt(10, seed=3)])  # [2, 10]
    mask = torch.stack([LEFT[0], torch.zeros(10, dtype=torch.long)])  # row 1: nothing to attend
    plan, why = plan_request(model, ids, None, (), {"attention_mask": mask}, target_context=256)
    assert plan is None
    assert "all zeros" in why and "row 1" in why and "right padding" not in why, why


# options generate turns into prefix-only processors → the processors each row's list holds
SERVED = [
    ({"no_repeat_ngram_size": 2}, ["NoRepeatNGramLogitsProcessor"]),
    ({"do_sample": True, "typical_p": 0.5, "top_k": 0},
     ["TypicalLogitsWarper"]),
    ({"bad_words_ids": [[5], [6, 7]], "suppress_tokens": [8]},
     ["NoBadWordsLogitsProcessor", "SuppressTokensLogitsProcessor"]),
    ({"logits_processor": LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)]),
      "repetition_penalty": 1.3},
     ["RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor"]),
    ({"prefix_allowed_tokens_fn": lambda b, ids: [4]}, ["PrefixConstrainedLogitsProcessor"]),
]


@pytest.mark.parametrize("case,names", SERVED, ids=[n[0] for _, n in SERVED])
def test_prefix_only_processors_are_planned_as_generate_builds_them(model, case, names):
    ids = torch.cat([IDS, prompt(10, seed=3)])
    mask = torch.cat([LEFT, torch.ones_like(LEFT)])
    plan, why = plan_request(model, ids, None, (), {"attention_mask": mask,
                                                     "max_new_tokens": 4} | case)
    assert plan is not None, why
    assert len(plan.processors) == 2  # one list per row
    for lst in plan.processors:
        assert [type(p).__name__ for p in lst] == names
    # the plain path keeps the loop's own processing
    plain, _ = plan_request(model, IDS, None, (), {"max_new_tokens": 4, "top_k": 3,
                                                   "do_sample": True})
    assert plain.processors is None


def test_a_mask_with_holes_runs_the_kept_tokens_and_holds_the_row(model):
    mask = torch.ones_like(IDS)
    mask[0, :2] = 0  # left padding
    mask[0, 5] = 0  # a hole
    plan, why = plan_request(model, IDS, None, (), {"attention_mask": mask, "max_new_tokens": 4})
    assert plan is not None, why
    keep = mask[0].bool()
    assert torch.equal(plan.input_ids, IDS[:, keep])
    assert torch.equal(plan.held[0], IDS) and torch.equal(plan.pad_prefix, IDS[:, :2])
    left, _ = plan_request(model, IDS, None, (), {"attention_mask": LEFT, "max_new_tokens": 4})
    assert left.held is None  # left padding alone: no row is held
