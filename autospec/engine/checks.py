"""Checks run once at ``wrap`` time, so that bad pairs fail before any work."""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["check_pair", "PairMismatchError", "Layout", "attention_layout"]


class PairMismatchError(ValueError):
    """The draft cannot speculate for this target (different tokens, architecture …)."""


def _vocab_rows(model) -> int:
    emb = model.get_output_embeddings()
    if emb is None:
        raise PairMismatchError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return emb.weight.shape[0]


def check_pair(target, draft, *, tokenizer=None, draft_tokenizer=None, match_draft=True) -> None:
    """Raise a clear error if ``draft`` cannot serve ``target`` exactly; align device/dtype.

    Token ids must mean the same text in both models. Tokenizers are compared by their full
    token → id maps and special tokens, not only their sizes. The models' vocabulary sizes may
    differ (embedding matrices are often padded), provided the tokenizer fits both: ids a model
    does not have get probability 0 under it, which keeps the rejection rule exact.
    """
    roles = (("target", target),) if draft is None else (("target", target), ("draft", draft))
    for role, m in roles:
        if m is None or not hasattr(m, "config") or not callable(
                getattr(m, "get_output_embeddings", None)):
            raise TypeError(
                f"the {role} must be a transformers causal LM (e.g. AutoModelForCausalLM), got "
                f"{type(m).__name__}: call autospec.wrap(target_model, draft_model), or "
                "autospec.load_pair() for the default pair")
        if not hasattr(m, "generate"):
            raise PairMismatchError(f"the {role} ({type(m).__name__}) is not a generative model")
    if draft is not None and _encoder_decoder(draft):
        raise PairMismatchError("the draft is an encoder-decoder model; autospec drafts with "
                                "decoder-only causal LMs (or with no draft model: wrap(target))")
    if draft is None or _encoder_decoder(target):
        # the n-gram proposer alone: nothing to match; an encoder-decoder target: its
        # requests go to its own generate (``attention_layout`` gives the reason)
        return
    if target is draft:
        log.info("autospec: draft is the target itself: every draft token will be accepted")
    vt, vd = _vocab_rows(target), _vocab_rows(draft)
    tok_t, tok_d = tokenizer, draft_tokenizer
    if tok_t is not None and tok_d is not None and tok_t is not tok_d:
        _compare_tokenizers(tok_t, tok_d)
    tok = tok_t or tok_d
    if vt != vd:
        if tok is None:
            raise PairMismatchError(
                f"target and draft vocabulary sizes differ ({vt} vs {vd}): pass tokenizer= "
                "(and draft_tokenizer= if it differs) so autospec can check that they share "
                "token ids")
        if len(tok) > min(vt, vd):
            raise PairMismatchError(
                f"the tokenizer has {len(tok)} tokens but the {'target' if vt < vd else 'draft'}"
                f" has only {min(vt, vd)} output rows: these models do not share a vocabulary")
        log.info("autospec: vocab sizes %d (target) and %d (draft) differ only in padding "
                 "beyond the tokenizer's %d tokens", vt, vd, len(tok))

    t_param = next(target.parameters())
    d_param = next(draft.parameters())
    if d_param.device != t_param.device or d_param.dtype != t_param.dtype:
        what = (f"draft on {d_param.device} as {d_param.dtype}, target on {t_param.device} "
                f"as {t_param.dtype}")
        if not match_draft:
            raise PairMismatchError(f"{what}: move the draft (draft.to(...)) or pass "
                                    "match_draft=True")
        log.warning("autospec: %s: moving the draft to the target's device and dtype", what)
        draft.to(device=t_param.device, dtype=t_param.dtype)


def _encoder_decoder(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def _compare_tokenizers(a, b) -> None:
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only_a = len(va.keys() - vb.keys())
        only_b = len(vb.keys() - va.keys())
        moved = sum(1 for t, i in va.items() if t in vb and vb[t] != i)
        raise PairMismatchError(
            f"target and draft tokenizers differ: {only_a} tokens only in the target's, "
            f"{only_b} only in the draft's, {moved} with different ids. Speculative decoding "
            "needs a draft that shares the target's tokenizer")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(a, attr, None) != getattr(b, attr, None):
            raise PairMismatchError(
                f"tokenizers agree on tokens but differ in {attr} ({getattr(a, attr, None)} vs "
                f"{getattr(b, attr, None)})")


# -- attention layouts ----------------------------------------------------------------------
SERVED_LAYERS = ("full_attention", "sliding_attention")
MASKED_ATTENTION = ("sdpa", "eager")  # implementations that take the engine's own 4-D masks


@dataclass(frozen=True)
class Layout:
    """How a model's layers attend, as the engine's slot cache must honour it.

    kinds: per layer "full_attention" or "sliding_attention"; window: the sliding layers'
    window (tokens a query attends to, itself included); by_type: whether the model takes one
    mask per layer type (``layer_types`` in its config) rather than one for every layer;
    problem: why the engine cannot serve the model exactly (None: it can)."""

    kinds: tuple[str, ...] = ()
    window: int | None = None
    by_type: bool = False
    attention: str = "eager"
    problem: str | None = None

    @property
    def sliding(self) -> bool:
        return "sliding_attention" in self.kinds

    def batch_problem(self) -> str | None:
        """Why a batch (B > 1) cannot run: sliding windows over slots with holes need the
        engine's own masks, which only sdpa and eager attention take."""
        if self.problem is None and self.sliding and self.attention not in MASKED_ATTENTION:
            return (f"sliding-window attention at batch > 1 with {self.attention!r} attention "
                    f"(the engine's masks need one of {', '.join(MASKED_ATTENTION)})")
        return None


def attention_layout(model, role: str = "target") -> Layout:
    """The rule for which attention layouts the engine serves, read from the model's config:

    - full attention in every layer: served (the reference case);
    - sliding windows (every layer, Mistral-style; or alternating with full layers,
      Gemma-2/3- and Qwen2-style): served. The engine keeps every token in a full cache (a
      sliding cache drops what a rejected block needs back), and windows are applied by the
      attention masks: at batch 1 by the model's own, at B > 1 by the engine's, built from
      each slot's position (holes left by rejected drafts must not count as tokens);
    - anything else (encoder-decoder models such as T5 and BART, recurrent or linear-attention
      layers, chunked attention, layers that share another's cache): not served; such
      requests go to the original ``generate``, with this reason logged.

    Remembered per model and attention implementation (every request asks)."""
    key = (role, getattr(model.config, "_attn_implementation", None))
    known = _LAYOUTS.setdefault(model, {})
    layout = known.get(key)
    if layout is None:
        layout = known[key] = _layout(model, role)
    return layout


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layout(model, role: str) -> Layout:
    """The layout of ``model`` read from its config (see ``attention_layout``)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    attention = getattr(cfg, "_attn_implementation", None) or "eager"
    if _encoder_decoder(model):
        return Layout(attention=attention,
                      problem=f"the {role} ({type(model).__name__}) is an encoder-decoder model "
                              "(autospec speculates for decoder-only causal LMs)")
    params = inspect.signature(model.forward).parameters
    if "past_key_values" not in params and "cache" not in params:
        return Layout(attention=attention,
                      problem=f"the {role} ({type(model).__name__}) takes no KV cache")
    n = getattr(cfg, "num_hidden_layers", None) or 0
    types = getattr(cfg, "layer_types", None)
    by_type = types is not None
    if types is None:
        sliding = (getattr(cfg, "sliding_window", None) is not None
                   and getattr(cfg, "use_sliding_window", True) is not False)
        types = ["sliding_attention" if sliding else "full_attention"] * n
        if getattr(cfg, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
    other = sorted(set(types) - set(SERVED_LAYERS))
    if other:
        return Layout(kinds=tuple(types), attention=attention, by_type=by_type,
                      problem=f"the {role}'s layers of type {', '.join(map(repr, other))} "
                              "keep state the engine cannot roll back to an accepted prefix")
    if getattr(cfg, "kv_sharing_modes", None) is not None:
        return Layout(kinds=tuple(types), attention=attention, by_type=by_type,
                      problem=f"the {role}'s layers share KV caches")
    window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
    return Layout(kinds=tuple(types), window=window, by_type=by_type, attention=attention)
