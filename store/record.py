"""What the runtime hands the store: plain values, no torch, no SQLAlchemy.

A ``RequestRecord`` is built once per request at the end of ``generate`` (off the per-token
path) and queued for the background writer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PairInfo", "RequestRecord", "TRACE_GREEDY", "TRACE_SAMPLED", "UNOBSERVED",
           "TRACE_CATCH_UP_MAX", "NGRAM_NONE", "MATCH_REACH", "NGRAM_KEYS", "SUFFIX_KEYS",
           "CATEGORY_SOURCES", "trace_acceptance", "check_category"]

from autospec.traces import (  # noqa: E402  (the one definition: torch-free)
    MATCH_REACH,
    NGRAM_NONE,
    TRACE_CATCH_UP_MAX,
    TRACE_GREEDY,
    TRACE_SAMPLED,
    UNOBSERVED,
)

# a request's n-gram counters (``RequestRecord.ngram``)
NGRAM_KEYS = ("max_n", "min_n", "drafts", "drafted", "accepted", "accepted_per_position",
              "drafted_per_position", "lookup_s")
# a request's suffix-decoding counters (``RequestRecord.suffix``)
SUFFIX_KEYS = NGRAM_KEYS[2:]
CATEGORY_SOURCES = ("given", "auto", "default")

CATEGORY_RULE = ("a category is a non-blank string of any Unicode text except NUL (U+0000) and "
                 "lone surrogates")


def check_category(category: object) -> str:
    """The one rule for a category, wherever one comes from (``generate(category=...)``,
    ``wrap(category=...)``, a categoriser's classes, a record reaching the store): free text
    (quotes, unicode, any length) that is not blank and that every backend can store, so no
    NUL characters (PostgreSQL refuses them) and no lone surrogates (not encodable as UTF-8).
    Returns the category; raises ValueError saying what is allowed."""
    if not isinstance(category, str):
        raise ValueError(f"category must be a string, got {type(category).__name__}: "
                         f"{CATEGORY_RULE}")
    if not category.strip():
        raise ValueError(f"category must be a non-empty string, not blank, got {category!r}: "
                         f"{CATEGORY_RULE}")
    if "\x00" in category:
        raise ValueError(f"category {category!r} contains a NUL character, which no store "
                         f"backend can hold: {CATEGORY_RULE}")
    try:
        category.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"category {category!r} is not valid Unicode text ({exc.reason}): "
                         f"{CATEGORY_RULE}") from None
    return category


@dataclass(frozen=True)
class PairInfo:
    """Identifies a model pair on a kind of hardware; rows are shared by every request."""

    target: str  # name or path of the target model
    draft: str
    dtype: str  # e.g. "bfloat16"
    hardware: str  # e.g. "cpu: Intel Xeon (2 threads)" or "cuda: NVIDIA H200"
    target_param_bytes: int = 0
    draft_param_bytes: int = 0


@dataclass
class RequestRecord:
    pair: PairInfo
    category: str
    policy: str
    greedy: bool
    prompt_tokens: int
    new_tokens: int
    iterations: int
    drafts: int
    drafted: int
    accepted: int
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    k_schedule: bytes  # one byte per iteration: the k run
    accepted_schedule: bytes  # one byte per iteration: accepted count
    wall_s: float
    prefill_s: float
    draft_s: float
    draft_forwards: int
    target_s_by_n: dict[int, list[float]]  # tokens scored → forward times (s)
    trace_kind: str
    trace: bytes  # one byte per generated position (see TRACE_*)
    stop_reason: str = ""
    bandwidth_bytes_per_s: float | None = None  # achieved by the target's forwards
    bandwidth_peak_bytes_per_s: float | None = None
    nvml_mem_busy_pct: float | None = None
    nvml_sm_util_pct: float | None = None
    prompt_text: str | None = None  # only with log_text=True
    output_text: str | None = None
    created_at: float = field(default_factory=time.time)
    category_source: str = "given"  # "given" (by the caller), "auto" (categoriser), "default"
    features: bytes | None = None  # hashed prompt-token n-grams (autospec.categorize.categorizer)
    predicted_alpha: float | None = None  # the categoriser's acceptance forecast
    confidence: bytes | None = None  # per generated position, as the trace (see above)
    # Batched generate: one record per row. ``batch_size`` is the batch the row started in;
    # its forwards are listed by the batch they ran at: ``target_s_by_bn`` ((B, n) → seconds
    # of a forward scoring n tokens per row) and ``draft_s_by_b`` (B → seconds per proposed
    # token). The category statistics' timing sums (batch 1's cost curve) take
    # ``target_s_by_n``, ``draft_s`` and ``draft_forwards`` from batch_size 1 requests only.
    batch_size: int = 1
    target_s_by_bn: dict[tuple[int, int], list[float]] | None = None
    draft_s_by_b: dict[int, list[float]] | None = None
    # How the forwards ran (``autospec.engine.runners.path_name``): "eager", "static",
    # "static+cuda-graphs", or "target/draft" where they differ. Timings from different paths
    # measure different things, so the store keeps costs per (pair, path) (``pair_costs``)
    # and cost queries read one path. None: unknown (every request logged before 0005); such a
    # request counts for acceptance and counters, never for costs.
    path: str | None = None
    # The n-gram (prompt-lookup) proposer (0006). Its iterations are not in drafts, drafted,
    # accepted or the per-position lists above (those stay the draft model's); k_schedule and
    # accepted_schedule hold every iteration. ``ngram``: {"max_n", "min_n" (the index's
    # settings), "drafts", "drafted", "accepted", "accepted_per_position",
    # "drafted_per_position" (its iterations, counted as the draft model's are), "lookup_s"
    # (host seconds of its lookups)}; None: unknown (batch > 1, or logged before 0006).
    # ``proposer_schedule``: one byte per iteration, beside k_schedule: 1 the n-gram proposer
    # drafted it, 2 suffix decoding, 0 the draft model (or nobody, k = 0)
    # (``autospec.traces.PROPOSER_CODES``); None when no iteration was a lookup's.
    # ``ngram_trace``: one byte per generated position, as the trace (see NGRAM_NONE;
    # ``autospec.ngram.ngram_trace``); None: not computed.
    ngram: dict[str, Any] | None = None
    proposer_schedule: bytes | None = None
    ngram_trace: bytes | None = None
    # The draft model's catch-up forwards (0007): (tokens it took in, seconds) for each forward
    # over more than 2 tokens it had not seen — the prompt at its first use, and what k = 0 or
    # the n-gram proposer emitted since. The points of the pair's C(g), which the live policy
    # prices resuming the draft with and replay charges (``queries.catch_ups``). None: not
    # recorded (batch > 1, or logged before 0007); [] none happened.
    draft_catch_ups: list[tuple[int, float]] | None = None
    # Suffix decoding (0008), where the call had the suffix proposer. ``suffix``: its
    # counters, as ``ngram``'s without the settings ({"drafts", "drafted", "accepted",
    # "accepted_per_position", "drafted_per_position", "lookup_s": host seconds of its
    # lookups in the iterations it drafted}); its blocks are not in the draft model's counters.
    # ``suffix_trace``: SUFFIX_TRACE_WIDTH bytes per generated position, what it would have
    # drafted there from the category's memory as the request saw it (match length, agreeing
    # tokens, draft length; ``autospec.suffix.suffix_trace``) — numbers only, no tokens.
    # None: not recorded (no suffix proposer, or logged before 0008).
    suffix: dict[str, Any] | None = None
    suffix_trace: bytes | None = None
    # The policy's decision records (0009): ``autospec.policies.explain`` records of the
    # iterations kept, each with its "iteration" (``LoopStats.decisions``); stored compressed
    # (``store.decisions``). None: none kept.
    decisions: list[dict[str, Any]] | None = None
    # Deferred work: a callable taking the record and returning the finished record (or None:
    # finished in place), run once by the store before validating it, on the writer thread
    # (``StoreWriter``), or by ``validate_record`` for a direct ``Store.write``. Work too slow
    # for the request's thread goes here (the n-gram trace). A failure in it counts as an
    # invalid record (logged, counted, the record skipped), never reaching ``generate``.
    finish: Callable[[RequestRecord], RequestRecord | None] | None = field(
        default=None, repr=False, compare=False)


def trace_acceptance(kind: str, trace: bytes) -> float | None:
    """The acceptance a request saw, from its trace: the share of observed positions whose
    draft token matched (greedy) or the mean β (sampled). Independent of the k that ran, so
    requests served with different k (or k = 0) compare. None if nothing was observed."""
    seen = [v for v in trace if v != UNOBSERVED]
    if not seen:
        return None
    if kind == TRACE_GREEDY:
        return sum(1 for v in seen if v == 1) / len(seen)
    return sum(seen) / (254 * len(seen))
