"""Logits → probabilities under a request's generation config.

Pure functions, vectorised over positions. The same processing is applied to the draft and the
target: the rejection rule is exact for any draft distribution q, but q must be the
distribution the draft token was actually sampled from, and the closer q is to p the more is
accepted.

Each step mirrors the transformers logits processor of the same name, in the order
``generate`` applies them (repetition penalty, min-length EOS suppression, then for sampling
temperature, top-k, top-p, min-p), and the tests check them against those processors. The one
difference is that here position j of a block sees the tokens *before* it in the block (the
draft tokens already proposed), which is what ``generate`` would see one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# top-k + top-p over the top-k values from this vocabulary size on (the result is the same;
# below it a sort of the row costs less than the bookkeeping that avoids one)
FAST_TOP_P_VOCAB = 2048

__all__ = ["SamplingConfig", "process_logits", "logits_to_probs", "sample", "seen_tokens", "block_presence"]


@dataclass(frozen=True)
class SamplingConfig:
    """The part of a ``GenerationConfig`` that shapes the next-token distribution."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        # top_p = 0 keeps only the most likely token, as generate's TopPLogitsWarper does
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def uses_presence(self) -> bool:
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    @classmethod
    def from_generation_config(cls, gc) -> SamplingConfig:
        """Read the fields ``generate`` would use; warpers only count when sampling."""
        do_sample = bool(gc.do_sample)
        return cls(
            do_sample=do_sample,
            temperature=float(gc.temperature) if do_sample and gc.temperature is not None else 1.0,
            top_k=gc.top_k if do_sample and gc.top_k else None,
            top_p=gc.top_p if do_sample and gc.top_p is not None and gc.top_p < 1.0 else None,
            min_p=gc.min_p if do_sample else None,
            repetition_penalty=gc.repetition_penalty,
        )


def seen_tokens(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids [B, L] → bool [B, V]: which tokens occur (for the repetition penalty)."""
    seen = torch.zeros(ids.shape[0], vocab_size, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids, True)


def block_presence(base: torch.Tensor, block: torch.Tensor | None, npos: int) -> torch.Tensor:
    """Which tokens each position of a block has seen: base [B, V] plus, at position j, the
    block's tokens before it (block [B, ≥ npos-1]). Returns bool [B, npos, V]."""
    seen = base[:, None, :].repeat(1, npos, 1)  # [B, npos, V]
    if block is not None and npos > 1:
        hits = torch.zeros_like(seen)
        hits[:, 1:].scatter_(2, block[:, : npos - 1, None], True)  # block[j-1] first seen at j
        seen |= hits.cummax(dim=1).values
    return seen


def process_logits(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    *,
    seen: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply the config to raw logits [B, n, V] → processed scores [B, n, V] (float32).

    seen: [B, n, V] bool, tokens each position has seen (for the repetition penalty).
    banned: [n, V] or [B, n, V] bool, tokens forced to −inf at each position (EOS before
    min_new_tokens).
    """
    scores = logits.float()
    if cfg.uses_presence:
        if seen is None:
            raise ValueError("repetition_penalty needs the `seen` mask")
        pen = cfg.repetition_penalty
        # negative logits are multiplied, positive ones divided: both lower the probability
        penalised = torch.where(scores < 0, scores * pen, scores / pen)
        scores = torch.where(seen, penalised, scores)
    if banned is not None:
        scores = scores.masked_fill(banned, float("-inf"))
    if not cfg.do_sample:
        return scores
    if cfg.temperature != 1.0:
        scores = scores / cfg.temperature
    top_p = cfg.top_p if cfg.top_p is not None and cfg.top_p < 1.0 else None
    if cfg.top_k and top_p is not None and scores.shape[-1] >= max(FAST_TOP_P_VOCAB, 4 * cfg.top_k):
        scores = _top_k_top_p(scores, cfg.top_k, top_p)
    else:
        if cfg.top_k:
            k = min(cfg.top_k, scores.shape[-1])
            kth = torch.topk(scores, k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if top_p is not None:
            scores = _top_p_full_sort(scores, top_p)
    if cfg.min_p is not None:
        probs = scores.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        drop = probs < cfg.min_p * top
        drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def _top_p_full_sort(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """TopPLogitsWarper's own computation: sort the whole row, drop the ascending prefix whose
    cumulative probability stays within 1 − top_p (the most likely token always stays)."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1 - top_p)
    drop_sorted[..., -1:] = False  # keep at least the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def _top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float, *,
                 exact_ties: bool | None = None) -> torch.Tensor:
    """TopK then TopP, with top-p computed over the top-k values instead of a sort of the
    whole row (a vocabulary-wide sort per draft token was most of the sampling overhead).

    Top-k keeps every score ≥ the k-th largest (``kth``): the k values ``topk`` returns plus
    any further ties at ``kth`` (the "boundary group", which topk returns only in part). In
    the ascending order TopP works in, the boundary group comes first, then the other
    candidates; TopP drops a prefix of that order. So: the candidates are sorted by (value,
    token id) — k elements — and the boundary group, whose members all have the same
    probability P, is handled by count: member r (0-based by id) has cumulative probability
    (r + 1)·P. The result is the full sort's whenever the cut does not fall between equal
    scores; where it does, which of the tied tokens stay depends on the sort's order of
    equal elements: this keeps the highest ids, as a stable sort does (CUDA's radix sort for
    vocabulary-sized rows). torch's CPU sort is not stable, so on the CPU such rows (cheap to
    detect: syncs cost nothing there) take the full sort, and the result is exactly
    TopPLogitsWarper's. ``exact_ties``: whether to do so (default: on the CPU).
    """
    vals, idx = torch.topk(scores, top_k, dim=-1)  # descending; ties in no particular order
    kth = vals[..., -1:]
    group = scores == kth  # the boundary group, all of it: [..., V]
    n_group = group.sum(dim=-1, keepdim=True)
    # candidates ascending by (value, id): a stable sort by id, then a stable one by value
    order = idx.argsort(dim=-1, stable=True)
    vals, idx = vals.gather(-1, order), idx.gather(-1, order)
    order = vals.argsort(dim=-1, stable=True)
    vals, idx = vals.gather(-1, order), idx.gather(-1, order)
    in_group = vals == kth  # the returned group members: the first ones
    extra = n_group - in_group.sum(dim=-1, keepdim=True)  # group members topk left out
    e = (vals - vals[..., -1:]).exp()
    e_group = (kth - vals[..., -1:]).exp()
    z = e.sum(dim=-1, keepdim=True) + extra * e_group
    p_group = e_group / z
    # cumulative probability of each candidate in the full ascending order
    cum = (e / z).cumsum(dim=-1) + extra * p_group
    thr = 1 - top_p
    drop_c = cum <= thr
    drop_c[..., -1:] = False  # keep at least the most likely token
    # boundary group: how many of its members (lowest ids first) fall in the dropped prefix;
    # all of it when the group is the whole support but one stays (the forced keep)
    only_group = in_group[..., -1:]
    n_drop_group = torch.where((drop_c & ~in_group).any(dim=-1, keepdim=True), n_group,
                               torch.floor(thr / p_group).to(n_group.dtype).clamp(0))
    n_drop_group = torch.minimum(n_drop_group, n_group - only_group.to(n_group.dtype))
    # a cut between equal scores: inside the group, or between equal candidates past it
    split_group = (n_drop_group > 0) & (n_drop_group < n_group)
    split_cand = (drop_c[..., :-1] & ~drop_c[..., 1:] & ~in_group[..., :-1]
                  & (vals[..., :-1] == vals[..., 1:])).any(dim=-1, keepdim=True)
    if exact_ties is None:
        exact_ties = scores.device.type == "cpu"
    if exact_ties:
        if bool((split_group | split_cand).any()):
            return _top_p_full_sort(scores.masked_fill(scores < kth, float("-inf")), top_p)
        # no cut between equal scores: what stays is every score ≥ the smallest kept one
        gone = torch.where(in_group, n_drop_group >= n_group, drop_c)
        least = vals.masked_fill(gone, float("inf")).amin(dim=-1, keepdim=True)
        return scores.masked_fill(scores < least, float("-inf"))
    drop = scores < kth
    drop |= torch.zeros_like(drop).scatter_(-1, idx, drop_c & ~in_group)
    rank = group.to(torch.int32).cumsum(dim=-1)  # 1-based rank by id inside the group
    drop |= group & (rank <= n_drop_group)
    return scores.masked_fill(drop, float("-inf"))


def logits_to_probs(scores: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Processed scores [B, n, V] → probabilities [B, n, V]; one-hot at the argmax for greedy."""
    if cfg.do_sample:
        return scores.softmax(dim=-1)
    # greedy is sampling from a one-hot distribution (ties go to the lowest id, as torch.argmax)
    probs = torch.zeros_like(scores)
    probs.scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row: probs [..., V] → tokens [...] (long).

    The exponential-race form of ``torch.multinomial(probs, 1)``: argmax of p / E with
    E ~ Exp(1) drawn from the same generator, which is what multinomial itself computes for
    one sample (same draws, same tokens, same generator state afterwards), minus its
    validity check, a host sync per call that would stall a GPU every draft token."""
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(dim=-1)


def invalid_probs(*probs: torch.Tensor | None) -> torch.Tensor:
    """A 1-element long tensor, nonzero when any of ``probs`` holds NaN, inf or a negative
    value: ``torch.multinomial``'s validity check, computed on the device so that it can ride
    on a sync the caller makes anyway instead of costing one per draw."""
    given = [p for p in probs if p is not None]
    # each tensor's least and greatest value (NaN in either where it holds one): a value out
    # of [0, the dtype's largest] makes its end one
    ends = [v for p in given if p.numel() for v in torch.aminmax(p)]
    if not ends:
        return torch.zeros(1, dtype=torch.long, device=given[0].device if given else None)
    ends = torch.stack(ends)
    return (ends.clamp(0, torch.finfo(ends.dtype).max) != ends).sum(0, keepdim=True)


def raise_invalid_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                        position: int) -> None:
    """The error ``generate`` would give (its ``torch.multinomial`` refuses such rows), naming
    the model whose distribution is broken."""
    which = [name for name, p in (("target", target_probs), ("draft", draft_probs))
             if p is not None and p.numel() and bool(invalid_probs(p))]
    raise RuntimeError(
        f"the {' and '.join(which) or 'sampling'} model's next-token probabilities contain NaN, "
        f"inf or a negative value at generated token {position} (torch.multinomial, which "
        "generate samples with, refuses them too). Usually the logits overflowed: load the "
        "model in bfloat16 or float32 rather than float16, or check its weights for NaN.")
