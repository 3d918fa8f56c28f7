"""Checks run once at ``wrap`` time, so that bad pairs fail before any work."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

__all__ = ["check_pair", "PairMismatchError"]


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
        if getattr(m.config, "is_encoder_decoder", False):
            raise PairMismatchError(f"the {role} is an encoder-decoder model; autospec "
                                    "speculates for decoder-only causal LMs")
        if not hasattr(m, "generate"):
            raise PairMismatchError(f"the {role} ({type(m).__name__}) is not a generative model")
    if draft is None:  # the n-gram proposer alone: nothing to match
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
