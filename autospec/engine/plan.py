"""The mapping from a ``generate`` call to a plan for the speculative loop, or to the reason
the original ``generate`` must serve it.

A pure function of the call (its arguments and ``GenerationConfig``, merged with the model's
defaults exactly as ``generate`` merges them): it runs no forward (an ``inputs_embeds`` call
looks its ids up in the embedding layer, whose probe it keeps), changes nothing the caller
passed and decides every request the same way. Where the call carries logits processors it
builds generate's list for each row (``autospec.engine.processors``).
``Controller.generate`` acts on its answer; ``tests/test_plan.py`` holds its table of cases
(each generate argument → a plan field or a fallback reason).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from autospec.engine.sampling import SamplingConfig

__all__ = ["Plan", "plan_request", "UNSUPPORTED", "FALLBACK_ARGS", "OWN_ARGS"]

# GenerationConfig fields that change the output and that the loop does not implement:
# name → the value that means "not in use". Anything else set here goes to the original
# generate. (Fields that only steer beam search or transformers' own assistant are ignored.)
UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "penalty_alpha": None,
    "num_return_sequences": 1, "encoder_no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0, "force_words_ids": None, "constraints": None,
    "guidance_scale": None, "watermarking_config": None, "dola_layers": None,
    "prompt_lookup_num_tokens": None, "token_healing": False, "low_memory": None,
    "output_attentions": False, "output_hidden_states": False, "speculation_type": None,
    "use_mtp": False, "assistant_early_exit": None,
}
# (the options generate turns into prefix-only logits processors are served through them:
# ``autospec.engine.processors.LIST_OPTIONS``)
# generate() arguments that, when given, send the request to the original generate
FALLBACK_ARGS = ("assistant_model", "negative_prompt_ids", "custom_generate",
                  "assistant_tokenizer")
OWN_ARGS = ("category", "k", "generator")
# generate() arguments the plan reads itself (the rest merge into the GenerationConfig)
_CALL_ARGS = ("streamer", "synced_gpus", "stopping_criteria", "tokenizer", "logits_processor",
              "prefix_allowed_tokens_fn")


@dataclass(frozen=True)
class Plan:
    """A request the loop can serve: the prompt without padding and how to generate."""

    input_ids: torch.Tensor  # [1, L] after removing left padding
    pad_prefix: torch.Tensor  # [1, P] the removed padding, put back in front of the output
    sampling: SamplingConfig
    max_new_tokens: int
    min_new_tokens: int
    eos: tuple[int, ...]
    stopping_criteria: object
    return_dict: bool
    output_scores: bool
    output_logits: bool
    use_cache: bool  # False: generate returns no cache (``cache=None``)
    # batch > 1: each row's prompt [1, L_i] and left padding [1, P_i]; the padded input as
    # given; the id that fills rows which finished early (generate's pad_token_id)
    rows: tuple = ()
    padded: torch.Tensor | None = None
    pad_token_id: int | None = None
    # the logits processors generate would apply, one list per row, applied at every position
    # with its prefix (``autospec.engine.processors``); None: the loop's own processing serves
    processors: tuple | None = None
    # each row as generate's input holds it ([1, W]), where its attention_mask has holes (the
    # model runs the row's unmasked tokens, ``input_ids``/``rows``: the same positions and
    # attention); None: no row has holes
    held: tuple | None = None
    attention_mask: torch.Tensor | None = None  # as given (a cache generate returns reads it)
    # the call gave inputs_embeds alone: ``input_ids`` are the tokens they embed, and generate's
    # row holds none of them (``held`` is empty: the output is the new tokens alone)
    from_embeds: bool = False

    @property
    def batch(self) -> int:
        return len(self.rows) if self.rows else 1


def plan_request(model, inputs, generation_config=None, args=(), kwargs=None, *,
                 tokenizer=None, target_context: int | None = None):
    """``generate``'s arguments → ``(Plan, "")`` for a request the loop serves exactly, or
    ``(None, reason)`` for one the original ``generate`` must serve (or refuse).

    model: the target (its generation_config supplies defaults, as in generate); kwargs: the
    call's keyword arguments without autospec's own (category, k, generator); tokenizer: for
    stop_strings when the call passes none; target_context: the target's context length.
    Raises ValueError for a request no path can serve (a prompt longer than the context)."""
    kwargs = {} if kwargs is None else kwargs
    from_embeds = kwargs.get("inputs_embeds") is not None
    if from_embeds:
        kwargs, reason = _from_embeds(model, inputs, kwargs)
        if kwargs is None:
            return None, reason
    got, reason = _inputs(inputs, args, kwargs)
    if got is None:
        return None, reason
    input_ids, mask, kw = got
    gc, model_kwargs = _merge_config(model, generation_config, kw)
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None
                    and k not in ("use_cache",)}
    if model_kwargs:
        return None, f"model arguments {sorted(model_kwargs)}"
    for field, off in UNSUPPORTED.items():
        val = getattr(gc, field, off)
        if val is not None and val != off and not (field == "guidance_scale" and val == 1):
            return None, f"generation option {field}={val!r}"
    if gc.return_dict_in_generate and gc.cache_implementation not in (None, "dynamic"):
        return None, (f"return_dict_in_generate with cache_implementation="
                      f"{gc.cache_implementation!r} (generate returns that cache; the loop "
                      "returns transformers' DynamicCache)")
    crit, reason = _criteria(gc, kwargs, tokenizer)
    if reason:
        return None, reason
    rows, reason = _rows(model, input_ids, mask, target_context)
    if rows is None:
        return None, reason
    held = _held(input_ids, mask, rows)
    if from_embeds:
        if held is not None:
            return None, "inputs_embeds with an attention_mask with holes"
        held = (input_ids[:, :0].to(model.device),)
    width = input_ids.shape[1]  # generate's input length: the padded width
    default_max = (kwargs.get("max_length") is None
                   and getattr(generation_config, "max_length", None) is None
                   and getattr(model.generation_config, "max_length", None) is None)
    max_new = _new_tokens(gc, width, default_max, getattr(model.config, "max_position_embeddings",
                                                          None))
    if max_new <= 0:
        return None, "nothing to generate (max_new_tokens <= 0)"
    eos = gc.eos_token_id
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    # min_new_tokens wins over min_length, as in generate (both count only with an EOS)
    if gc.min_new_tokens is not None:
        min_length = gc.min_new_tokens + width
    else:
        min_length = gc.min_length or 0
    _refuse_as_generate(gc, min_length, width, eos)
    min_new = math.ceil(min_length - width) if eos else 0
    ids, pad_prefix = rows[0]
    pad_id = gc.pad_token_id
    if pad_id is None and eos:
        pad_id = eos[0]  # as generate does (it warns)
    if len(rows) > 1 and pad_id is not None:
        if bool((input_ids[:, -1] == pad_id).any()):
            return None, "right padding (generate warns: decoder-only models need left padding)"
        if mask is None and bool((input_ids == pad_id).any()):
            return None, "padding without an attention_mask (generate infers one)"
    try:
        sampling = SamplingConfig.from_generation_config(gc)
    except ValueError as e:  # generate took them (checked above): let it serve them
        return None, f"generation settings the loop does not take ({e})"
    # generate's input row holds no token of an embedded prompt: its processors count from 0
    lists, reason = _processors(model, gc, kwargs, mask, width=0 if from_embeds else width,
                                max_length=(0 if from_embeds else width) + max_new,
                                min_length=max(0, min_length - (width if from_embeds else 0)),
                                rows=len(rows), eos=eos, force=from_embeds and bool(
                                    gc.repetition_penalty not in (None, 1.0)))
    if reason:
        return None, reason
    return Plan(
        input_ids=ids, pad_prefix=pad_prefix, sampling=sampling, max_new_tokens=max_new,
        min_new_tokens=max(0, min_new), eos=eos, stopping_criteria=crit,
        return_dict=bool(gc.return_dict_in_generate), output_scores=bool(gc.output_scores),
        output_logits=bool(gc.output_logits), use_cache=gc.use_cache is not False,
        rows=tuple(rows) if len(rows) > 1 else (),
        padded=input_ids.to(model.device) if len(rows) > 1 else None,
        pad_token_id=None if pad_id is None else int(pad_id),
        processors=lists, held=held, from_embeds=from_embeds,
        attention_mask=None if mask is None else mask.to(model.device),
    ), ""


def _from_embeds(model, inputs, kwargs):
    """A call that gave ``inputs_embeds`` alone, as the same call with the token ids they embed
    (``(kwargs, "")``): served only where every row of the embeddings is, bit for bit, the
    model's own embedding of a token — then the target's forwards are the ones generate runs,
    and every proposer has the ids it needs. Else ``(None, why)``."""
    embeds = kwargs["inputs_embeds"]
    if inputs is not None or kwargs.get("input_ids") is not None:
        return None, "inputs_embeds with input_ids"
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or embeds.shape[0] != 1:
        return None, "inputs_embeds at batch > 1 (or not a [1, L, H] tensor)"
    if kwargs.get("streamer") is not None:
        return None, "inputs_embeds with a streamer"
    ids = _embedded_ids(model, embeds[0])
    if ids is None:
        return None, ("inputs_embeds that are not the model's own token embeddings (a soft "
                      "prompt: the engine needs the prompt's token ids)")
    out = {k: v for k, v in kwargs.items() if k != "inputs_embeds"}
    out["input_ids"] = ids[None]
    return out, ""


def _embedded_ids(model, embeds: torch.Tensor) -> torch.Tensor | None:
    """The ids whose embeddings (``model.get_input_embeddings()``, a scaled one included)
    equal ``embeds`` [L, H] bit for bit, else None. Candidates are the ids whose embeddings
    agree on a few coordinates (``_embedding_probe``); the embedding of the ids found is then
    compared whole."""
    layer = model.get_input_embeddings()
    probe = _embedding_probe(layer)
    if probe is None or not embeds.shape[0] or embeds.shape[-1] != probe[1]:
        return None
    table, _, cols, dtype, device = probe
    if embeds.dtype != dtype:
        return None
    embeds = embeds.to(device)
    ids = []
    for row in embeds[:, cols]:
        hits = (table == row).all(dim=-1).nonzero().flatten()
        if not len(hits):
            return None
        with torch.no_grad():
            whole = layer(hits)
        found = next((int(h) for h, w in zip(hits, whole) if torch.equal(w, embeds[len(ids)])),
                     None)
        if found is None:
            return None
        ids.append(found)
    return torch.tensor(ids, dtype=torch.long, device=device)


_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _embedding_probe(layer):
    """(every id's embedding at four coordinates [V, 4], the width, the coordinates, dtype,
    device), computed once per embedding layer (and again if its weights change), chunk by
    chunk; None for a layer without a weight matrix."""
    weight = getattr(layer, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    key = (weight.data_ptr(), weight._version)
    got = _PROBES.get(layer)
    if got is not None and got[0] == key:
        return got[1]
    V, H = weight.shape
    cols = torch.linspace(0, H - 1, steps=min(4, H)).long().to(weight.device)
    parts = []
    with torch.no_grad():
        for start in range(0, V, 8192):
            ids = torch.arange(start, min(V, start + 8192), device=weight.device)
            parts.append(layer(ids)[:, cols])
    probe = (torch.cat(parts), H, cols, parts[0].dtype, weight.device)
    _PROBES[layer] = (key, probe)
    return probe


def _windowed(model) -> bool:
    from autospec.engine.checks import attention_layout

    try:
        return bool(attention_layout(model).sliding)
    except Exception:  # a layout the engine refuses: the controller says so itself
        return True


def _held(input_ids: torch.Tensor, mask, rows):
    """Each row of generate's input where one has holes (its kept tokens and left padding are
    not the whole row), else None."""
    if mask is None or all(ids.shape[1] + pad.shape[1] == input_ids.shape[1]
                           for ids, pad in rows):
        return None
    return tuple(input_ids[b : b + 1].to(ids.device) for b, (ids, _) in enumerate(rows))


def _processors(model, gc, kwargs, mask, *, width: int, max_length: int, min_length: int,
                rows: int, eos: tuple[int, ...], force: bool = False):
    """(each row's processor list, "") where the call needs them (or ``force``), (None, "")
    where the loop's own processing serves it, (None, why) where a processor cannot be applied
    per position."""
    from autospec.engine import processors as pr

    user = [_own(p) for p in kwargs.get("logits_processor") or []]
    prefix_fn = kwargs.get("prefix_allowed_tokens_fn")
    if not force and not pr.uses_lists(gc, user, prefix_fn):
        return None, ""
    reason = pr.not_prefix_only(user, rows)
    if reason:
        return None, reason
    try:
        lists = pr.row_lists(model, gc, width=width, max_length=max_length,
                             min_length=min_length, rows=rows, mask=mask, user_processors=user,
                             prefix_fn=prefix_fn, eos=eos, device=model.device)
    except (ValueError, TypeError) as e:  # generate raises it for these settings: let it
        return None, f"logits processor settings generate refuses ({e})"
    return tuple(lists), ""


def _own(processor):
    """A caller's processor as the loop applies it: xgrammar's own transformers processor (which
    follows one sequence per row, call by call) as an ``autospec.grammar.Grammar`` over the same
    grammar; any other as it is."""
    if type(processor).__module__.startswith("xgrammar"):
        from autospec.grammar import from_xgrammar

        return from_xgrammar(processor) or processor
    return processor


def _inputs(inputs, args, kwargs):
    """((input_ids, attention_mask, the other generate arguments), "") or (None, why not)."""
    if args:
        return None, "positional arguments beyond generation_config"
    for name in FALLBACK_ARGS:
        if kwargs.get(name) is not None:
            return None, f"`{name}` given"
    if kwargs.get("synced_gpus"):
        return None, "synced_gpus"
    kw = {k: v for k, v in kwargs.items() if k not in _CALL_ARGS}
    input_ids = inputs if inputs is not None else kw.pop("input_ids", None)
    kw.pop("input_ids", None)
    mask = kw.pop("attention_mask", None)
    if inputs is not None and kwargs.get("input_ids") is not None:
        return None, "both inputs and input_ids (generate refuses them)"
    if input_ids is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return None, "no 2-D input_ids tensor"
    if input_ids.dtype not in (torch.long, torch.int32):
        return None, f"input_ids of dtype {input_ids.dtype} (generate refuses non-integer ids)"
    if mask is not None and (not isinstance(mask, torch.Tensor)
                             or tuple(mask.shape) != tuple(input_ids.shape)):
        return None, "attention_mask of another shape than input_ids"
    if input_ids.shape[0] == 0:
        return None, "empty batch"
    if input_ids.shape[0] > 1 and kwargs.get("streamer") is not None:
        return None, "a streamer at batch > 1"
    return (input_ids, mask, kw), ""


def _criteria(gc, kwargs, tokenizer):
    """(the stopping criteria generate would build and the caller's, "") or (None, why)."""
    crit = None
    if gc.max_time is not None or gc.stop_strings is not None:
        crit = _extra_criteria(gc, kwargs.get("tokenizer") or tokenizer)
        if crit is None:
            return None, "stop_strings without a tokenizer"
    user_crit = kwargs.get("stopping_criteria")
    if user_crit:
        crit = list(crit or []) + list(user_crit)
    if crit:
        from transformers import StoppingCriteriaList

        crit = StoppingCriteriaList(crit)
    return crit or None, ""


def _rows(model, input_ids: torch.Tensor, mask, target_context: int | None):
    """(each row's prompt [1, L_i] and left padding [1, P_i], on the model's device, "") or
    (None, why the padding cannot be served). Raises ValueError for a prompt longer than the
    context (no path can serve it)."""
    rows = []
    for b in range(input_ids.shape[0]):
        ids, pad_prefix = input_ids[b : b + 1], input_ids[b : b + 1, :0]
        if mask is not None:
            keep = mask[b].bool()
            if not bool(keep.all()):
                if not bool(keep.any()):
                    return None, (f"a row whose attention_mask is all zeros (an empty "
                                  f"prompt: row {b})")
                first = int(keep.to(torch.int64).argmax())
                if not bool(keep[-1]):
                    return None, ("attention_mask with right padding (only left padding is "
                                  "supported, as generate expects)")
                pad_prefix = input_ids[b : b + 1, :first]
                if not bool(keep[first:].all()) and _windowed(model):
                    return None, ("attention_mask with holes on a model with sliding-window "
                                  "attention (its window counts the masked tokens)")
                # holes (masked tokens after the first kept one): the model runs the kept
                # tokens alone — generate's positions (the mask's cumulative sum) and
                # attention (masked keys hidden) are theirs — and its row is held whole
                ids = input_ids[b : b + 1, first:][:, keep[first:]]
        L = ids.shape[1]
        if L == 0:
            return None, "empty prompt"
        if target_context is not None and L >= target_context:
            raise ValueError(
                f"prompt of {L} tokens does not fit the target's context of "
                f"{target_context} tokens: shorten it (leave room for new tokens)")
        rows.append((ids.to(model.device), pad_prefix.to(model.device)))
    return rows, ""


def _new_tokens(gc, width: int, default_max: bool, max_positions: int | None) -> int:
    """How many tokens generate produces at most: it stops once the length reaches
    ``max_length`` (``max_new_tokens`` + the input, or the default 20 new tokens capped at
    the model's positions, or the given ``max_length``), so a fractional limit rounds up."""
    if gc.max_new_tokens is not None:
        max_length = gc.max_new_tokens + width
    elif default_max:
        max_length = (gc.max_length if gc.max_length is not None else 20) + width
        if max_positions is not None:
            max_length = min(max_length, max_positions)
    else:
        max_length = gc.max_length
    return max(0, math.ceil(max_length - width))


def _refuse_as_generate(gc, min_length, width: int, eos: tuple[int, ...]) -> None:
    """Raise what generate raises for these settings: build the logits processors it would
    build, under its conditions and in its order (their constructors are its checks)."""
    from transformers.generation import logits_process as lp

    if gc.repetition_penalty is not None and gc.repetition_penalty != 1.0:
        lp.RepetitionPenaltyLogitsProcessor(gc.repetition_penalty)
    if eos:
        eos_t = torch.tensor(eos)
        if min_length is not None and min_length > 0:
            lp.MinLengthLogitsProcessor(min_length, eos_t)
        if gc.min_new_tokens is not None and gc.min_new_tokens > 0:
            lp.MinNewTokensLengthLogitsProcessor(width, gc.min_new_tokens, eos_t)
    if not gc.do_sample:
        return
    if gc.temperature is not None and gc.temperature != 1.0:
        lp.TemperatureLogitsWarper(gc.temperature)
    if gc.top_k is not None and gc.top_k != 0:
        lp.TopKLogitsWarper(top_k=gc.top_k)
    if gc.top_p is not None and gc.top_p < 1.0:
        lp.TopPLogitsWarper(top_p=gc.top_p)
    if gc.min_p is not None:
        lp.MinPLogitsWarper(min_p=gc.min_p)


def _merge_config(model, generation_config, kw):
    """Merge defaults exactly as generate does (model's generation_config, then kwargs)."""
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        try:
            return prepare(generation_config, **kw)
        except TypeError:  # a transformers whose private signature moved: merge by hand
            pass
    import copy

    gc = copy.deepcopy(generation_config or model.generation_config)
    return gc, gc.update(**kw)


def _extra_criteria(gc, tokenizer):
    from transformers import MaxTimeCriteria, StopStringCriteria

    crit = []
    if gc.max_time is not None:
        crit.append(MaxTimeCriteria(max_time=gc.max_time))
    if gc.stop_strings is not None:
        if tokenizer is None:
            return None
        crit.append(StopStringCriteria(stop_strings=gc.stop_strings, tokenizer=tokenizer))
    return crit
