"""Logits processors the caller passes (or ``generate`` builds from its options), applied at
every position the loop scores, each with that position's prefix.

``generate`` scores one position per step: it calls its processor list with the batch's
sequences so far ([B, cur_len], left padding included) and the target's logits for the next
token. The loop scores a block of positions at once, so it calls the same list once per row and
position with the prefix that position comes after (the row's left padding, its tokens, then the
block's tokens before it). That is exact for a processor whose output depends only on that prefix
and the scores — *prefix-only* — which every processor transformers builds from a
``GenerationConfig`` option served here is, and which a caller's own processor declares with a
class attribute ``prefix_only = True``. A processor that cannot be shown prefix-only (it keeps
state across calls, reads the batch as a whole, or runs a model) sends the call to the original
``generate`` with its name in the reason.

The list is built by ``generate``'s own ``_get_logits_processor`` (its order, its checks), one
list per row: a row's list sees that row alone, with its own attention mask (the repetition
penalty's ``prompt_ignore_length``) and its batch index (``prefix_allowed_tokens_fn``).
"""

from __future__ import annotations

import copy

import torch

__all__ = ["PREFIX_ONLY", "LIST_OPTIONS", "is_prefix_only", "not_prefix_only", "uses_lists",
           "row_lists", "apply_lists", "forbidden_at"]

# transformers' processors whose output is a function of (input_ids row, scores row) alone:
# they read the row's tokens and length, never state kept between calls nor other rows
PREFIX_ONLY = frozenset({
    "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor", "NoRepeatNGramLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor",
    "ExponentialDecayLengthPenalty", "LogitNormalization", "TemperatureLogitsWarper",
    "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper",
})
# a processor that reads per-row state of the call it was built for: prefix-only per row,
# served where the caller's instance sees one row (batch 1)
_ROW_BOUND = frozenset({"RepetitionPenaltyLogitsProcessor", "PrefixConstrainedLogitsProcessor"})

# GenerationConfig options generate turns into prefix-only processors: served through the
# per-position lists (name → the value that means "not in use")
LIST_OPTIONS = {
    "no_repeat_ngram_size": 0, "bad_words_ids": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "sequence_bias": None, "renormalize_logits": False,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
}


def is_prefix_only(proc, batch: int = 1) -> bool:
    """Whether ``proc`` (one processor) can be applied per row and position exactly."""
    if getattr(proc, "prefix_only", False) is True:
        return True
    name = type(proc).__name__
    if type(proc).__module__.startswith("transformers."):
        if name in PREFIX_ONLY:
            return True
        if name in _ROW_BOUND:
            return batch == 1
    return False


def not_prefix_only(processors, batch: int) -> str:
    """The caller's processors that cannot be applied per position, as the reason the call goes
    to the original generate ("" when every one can)."""
    bad = [type(p).__name__ for p in processors if not is_prefix_only(p, batch)]
    if not bad:
        return ""
    return (f"logits processor {', '.join(bad)} is not known to depend on the prefix alone "
            "(a processor that does can say so with a class attribute `prefix_only = True`)"
            + (" at batch > 1" if batch > 1 and all(n in _ROW_BOUND for n in bad) else ""))


def uses_lists(gc, user_processors, prefix_fn) -> bool:
    """Whether a call needs the per-position lists (else the loop's vectorised processing, which
    covers the repetition penalty, min-length and the sampling warpers, serves it)."""
    if user_processors or prefix_fn is not None:
        return True
    return any(getattr(gc, f, off) not in (off, None) for f, off in LIST_OPTIONS.items())


def row_lists(model, gc, *, width: int, max_length: int, min_length: int, rows: int, mask,
              user_processors, prefix_fn, eos: tuple[int, ...], device) -> list:
    """One processor list per row, as ``generate`` builds its list for this call: ``gc`` with the
    call's length (``max_length``) and special tokens set as generate sets them; row b's list built
    with row b's attention mask and, for ``prefix_allowed_tokens_fn``, batch index b. The caller's
    processors are shared by every row's list (they are prefix-only). Raises what generate raises
    for settings it refuses."""
    gc = copy.deepcopy(gc)
    gc.max_length, gc.min_length = max_length, min_length
    gc._eos_token_tensor = (torch.tensor(eos, dtype=torch.long, device=device) if eos else None)
    lists = []
    for b in range(rows):
        fn = None if prefix_fn is None else (lambda _batch_id, ids, _b=b: prefix_fn(_b, ids))
        kwargs = {} if mask is None else {"attention_mask": mask[b : b + 1].to(device)}
        lists.append(model._get_logits_processor(
            generation_config=gc, input_ids_seq_length=width, encoder_input_ids=None,
            prefix_allowed_tokens_fn=fn, logits_processor=copy.copy(user_processors) or [],
            device=device, model_kwargs=kwargs))
    return lists


def apply_lists(lists, prefixes: list[torch.Tensor], raw: torch.Tensor,
                steps: torch.Tensor | None) -> torch.Tensor:
    """Each row's list at each position: raw [B, npos, V] → processed scores (float32).

    prefixes: row b's tokens before position 0 ([P_b], its left padding first); steps
    [B, ≥ npos − 1]: the tokens between position j − 1 and j (position j's prefix is
    ``prefixes[b]`` + ``steps[b, :j]``)."""
    B, npos, _ = raw.shape
    out = raw.float().clone()
    for b in range(B):
        seq = prefixes[b] if steps is None or npos == 1 else torch.cat(
            [prefixes[b], steps[b, : npos - 1]])
        base = prefixes[b].shape[0]
        procs = lists[b]
        for j in range(npos):
            out[b, j] = procs(seq[None, : base + j], out[b, j][None])[0]
    return out


def forbidden_at(procs, prefix: torch.Tensor, tokens: torch.Tensor, vocab: int) -> int:
    """The first j at which ``procs`` forbid ``tokens[j]`` (score −inf from zero scores) after
    ``prefix`` + ``tokens[:j]``; ``len(tokens)`` where none is forbidden."""
    seq = torch.cat([prefix, tokens])
    base = prefix.shape[0]
    for j, tok in enumerate(tokens.tolist()):
        scores = procs(seq[None, : base + j], torch.zeros(1, vocab))
        if scores[0, tok] == float("-inf"):
            return j
    return tokens.shape[0]
