"""What the runtime hands the store: plain values, no torch, no SQLAlchemy.

A ``RequestRecord`` is built once per request at the end of ``generate`` (off the per-token
path) and queued for the background writer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PairInfo", "RequestRecord", "ProposerRecord", "TRACE_GREEDY", "TRACE_SAMPLED",
           "UNOBSERVED", "TRACE_CATCH_UP_MAX", "NGRAM_NONE", "MATCH_REACH", "PROPOSER_KINDS",
           "CATEGORY_SOURCES", "trace_acceptance", "check_category", "check_proposer_name"]

from autospec.traces import (  # noqa: E402  (the one definition: torch-free)
    MATCH_REACH,
    NGRAM_NONE,
    TRACE_CATCH_UP_MAX,
    TRACE_GREEDY,
    TRACE_SAMPLED,
    UNOBSERVED,
)

CATEGORY_SOURCES = ("given", "auto", "default")
PROPOSER_KINDS = ("model", "lookup")  # a proposer's kind (``autospec.engine.proposers``)

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


def check_proposer_name(name: object) -> str:
    """A proposer's name as the store keys it: an ASCII identifier of at most 64 characters
    (``autospec.engine.proposers.register`` holds every registered one to the same rule)."""
    if not isinstance(name, str) or not name.isascii() or not name.isidentifier() or len(
            name) > 64:
        raise ValueError(f"a proposer's name must be an ASCII identifier of at most 64 "
                         f"characters, got {name!r}")
    return name


@dataclass(slots=True)
class ProposerRecord:
    """One proposer's share of a request (a row of ``request_proposers``): its kind ("model"
    or "lookup"), its blocks (iterations it proposed in), tokens proposed and accepted, per
    position i (0-based) how many of its blocks reached i and how many accepted it, the host
    seconds it spent proposing, and what its replay rule reads: its trace (bytes, in its own
    encoding, or a callable returning them that the writer runs off the hot path; None: not
    recorded), the model's confidence per generated position, its settings (JSON-ready)."""

    kind: str
    blocks: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    seconds: float = 0.0
    trace: Any = None
    confidence: bytes | None = None
    settings: dict[str, Any] | None = None


@dataclass(frozen=True)
class PairInfo:
    """Identifies a model pair on a kind of hardware; rows are shared by every request."""

    target: str  # name or path of the target model
    draft: str
    dtype: str  # e.g. "bfloat16"
    hardware: str  # e.g. "cpu: Intel Xeon (2 threads)" or "cuda: NVIDIA H200"
    target_param_bytes: int = 0
    draft_param_bytes: int = 0


@dataclass(slots=True)
class RequestRecord:
    pair: PairInfo
    category: str
    policy: str
    greedy: bool
    prompt_tokens: int
    new_tokens: int
    iterations: int
    k_schedule: bytes  # one byte per iteration: the k run
    accepted_schedule: bytes  # one byte per iteration: accepted count
    wall_s: float
    prefill_s: float
    draft_s: float
    draft_forwards: int
    target_s_by_n: dict[int, list[float]]  # tokens scored → forward times (s)
    trace_kind: str  # how its proposers' traces encode acceptance (see TRACE_*)
    # every proposer the request had, by name: its counters, its trace (``ProposerRecord``)
    proposers: dict[str, ProposerRecord] = field(default_factory=dict)
    stop_reason: str = ""
    # the tokens it could have generated (its limit; None: not known): replay shows a policy
    # the room the live run had, where an EOS or a criterion ended the request earlier
    max_new_tokens: int | None = None
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
    # Who drafted each iteration: the name of a proposer in ``proposers``, or None (a plain
    # step); the store keeps it as one byte per iteration (``requests.proposer_schedule``).
    proposer_schedule: list[str | None] | None = None
    # The draft model's catch-up forwards (0007): (tokens it took in, seconds) for each forward
    # over more than 2 tokens it had not seen — the prompt at its first use, and what k = 0 or
    # the n-gram proposer emitted since. The points of the pair's C(g), which the live policy
    # prices resuming the draft with and replay charges (``queries.catch_ups``). None: not
    # recorded (batch > 1, or logged before 0007); [] none happened.
    draft_catch_ups: list[tuple[int, float]] | None = None
    # The policy's decision records (0009): ``autospec.policies.explain`` records of the
    # iterations kept, each with its "iteration" (``LoopStats.decisions``); stored compressed
    # (``store.decisions``). None: none kept.
    decisions: list[dict[str, Any]] | None = None
    # the id of the batched generate call the row ran in (None: batch 1)
    batch_id: str | None = None
    # Deferred work: a callable taking the record and returning the finished record (or None:
    # finished in place), run once by the store before validating it, on the writer thread
    # (``StoreWriter``), or by ``validate_record`` for a direct ``Store.write``; a proposer's
    # trace given as a callable is computed there too. Work too slow for the request's thread
    # goes here (prompt lookup's trace). A failure in it counts as an invalid record (logged,
    # counted, the record skipped), never reaching ``generate``.
    finish: Callable[[RequestRecord], RequestRecord | None] | None = field(
        default=None, repr=False, compare=False)

    def model(self) -> tuple[str, ProposerRecord] | None:
        """(name, record) of its model proposer (the draft model), if it had one."""
        return next(((n, p) for n, p in self.proposers.items() if p.kind == "model"), None)


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
