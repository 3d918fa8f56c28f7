"""The store's tables (SQLAlchemy 2.0 typed models).

Layout (the Alembic migrations in ``migrations/versions`` create exactly this):

- ``pairs``: one row per (target, draft, dtype, hardware); requests and statistics point at it.
- ``requests``: one row per ``generate`` call: counters, timings, bandwidth figures and the
  compact k-schedule / accepted-schedule / acceptance trace (bytes, see ``records.TRACE_*``),
  and the batch size the request ran at (one row per row of a batched ``generate``).
- ``category_stats``: running sufficient statistics per (category, pair), updated in the same
  transaction as the request rows they summarise, so readers never scan ``requests``.
- ``tuned_params``: policy parameters an ``autospec tune`` job chose for a (category, pair),
  with their simulated throughput and provenance (study, trial, traffic window, hardware).
- ``categorizers``: fitted categorisation models (coefficients, not pickles) with the window
  of traffic they were fitted on and their held-out scores; versions per name.
- ``probes``: hardware probes of a pair (T_t(n) curve, T_d, bandwidth), a JSON payload each,
  and the (B, n) grid T_t(B, n), T_d(B) of batched probes.
- ``pair_costs`` (0010; per (category, pair, path) in ``category_costs`` from 0005 to
  0009): the batch-1 timing sums of one (pair, execution path) (``path``: "eager", "static",
  "static+cuda-graphs", ...), every category's requests pooled: costs are the pair's, once.
  ``category_paths`` (0010) counts a category's batch-1 requests per path (which path serves
  it), with no timings. Requests and probes carry the path too. Costs are read from one path
  only: a static-cache step and an eager one are different measurements and never meet in
  one S(k). Rows logged before 0005 have path NULL (unknown): they count in
  ``category_stats`` (acceptance, counters, and its timing sums, which are all paths
  together and no cost source) but in no path's costs.
- proposers (0011; ``autospec.engine.proposers``): every proposer a request had is a row of
  ``request_proposers`` keyed by (request, proposer name): its kind ("model": the draft
  model; "lookup"), its counters (blocks, tokens proposed and accepted, per position; host
  seconds), its trace (what its replay rule reads), the model's confidences, its settings.
  A request's ``proposer_schedule`` names who drafted each iteration as an index into its
  proposers sorted by name (1-based; 0: nobody, a plain step). ``category_proposers`` holds
  the running sums per (category, pair, proposer). Before 0011 the draft model's counters
  and trace were columns of ``requests``/``category_stats``, prompt lookup's (0006) and
  suffix decoding's (0008) columns of their own: 0011 moved every one into these rows.
- decision records (0009): requests carry the policy's reasons for the iterations kept
  (``decisions``: every iteration with ``generate(explain=True)``, else a sample), one
  compressed JSON array (``store.decisions``); ``autospec explain`` prints them.

Categories are free text of any length, so the tables are keyed and indexed on
``category_key`` = SHA-256 of the category's UTF-8 bytes (a B-tree entry in PostgreSQL cannot
exceed ~2.7 kB; a 10k-character category would not fit); the text itself is stored alongside.
Pairs are likewise unique on ``key`` = SHA-256 over their four identifying fields.

Times are timezone-aware UTC datetimes (SQLite stores them naive, in UTC).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "Pair", "Request", "RequestProposer", "CategoryStat", "CategoryProposer",
           "PairCost", "CategoryPath", "Probe", "TunedParams", "Categorizer", "UTCDateTime",
           "VERSION_TABLE"]

# Our own Alembic version table: Optuna's RDB storage (which may share the database) keeps its
# schema revision in the default ``alembic_version``.
VERSION_TABLE = "autospec_alembic_version"

# BIGINT in PostgreSQL; SQLite only auto-increments an ``INTEGER PRIMARY KEY``
BigId = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator):
    """Aware UTC datetimes in, aware UTC datetimes out, on every backend."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; pass an aware (UTC) datetime")
        value = value.astimezone(timezone.utc)
        return value if dialect.name == "postgresql" else value.replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), bytes: LargeBinary(), float: Float()}


class Pair(Base):
    __tablename__ = "pairs"
    __table_args__ = (UniqueConstraint("key", name="uq_pairs_key"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    key: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(Text)
    draft: Mapped[str] = mapped_column(Text)
    dtype: Mapped[str] = mapped_column(Text)
    hardware: Mapped[str] = mapped_column(Text)
    target_param_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    draft_param_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Request(Base):
    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_category_pair_created", "category_key", "pair_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    created_at: Mapped[datetime]
    category: Mapped[str] = mapped_column(Text)
    category_key: Mapped[str] = mapped_column(String(64))
    pair_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("pairs.id", name="fk_requests_pair"))
    policy: Mapped[str] = mapped_column(Text)
    greedy: Mapped[bool] = mapped_column(Boolean)
    # counters (vLLM convention: output tokens = accepted + recovered + bonus)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    new_tokens: Mapped[int] = mapped_column(Integer)
    iterations: Mapped[int] = mapped_column(Integer)
    # one byte per iteration
    k_schedule: Mapped[bytes]
    accepted_schedule: Mapped[bytes]
    # how its proposers' traces encode acceptance: "greedy" (0/1) or "sampled" (β)
    trace_kind: Mapped[str] = mapped_column(String(16))
    # timings (seconds)
    wall_s: Mapped[float]
    prefill_s: Mapped[float]
    draft_s: Mapped[float]
    draft_forwards: Mapped[int] = mapped_column(Integer)
    target_s_by_n: Mapped[dict[str, list[float]]] = mapped_column(JSON)  # "n" → [s, ...]
    # hardware figures, where measured
    bandwidth_bytes_per_s: Mapped[float | None]
    bandwidth_peak_bytes_per_s: Mapped[float | None]
    nvml_mem_busy_pct: Mapped[float | None]
    nvml_sm_util_pct: Mapped[float | None]
    # text only with log_text=True
    prompt_text: Mapped[str | None] = mapped_column(Text)
    output_text: Mapped[str | None] = mapped_column(Text)
    stop_reason: Mapped[str] = mapped_column(Text, default="")
    # the tokens it could have generated (0012; NULL: logged before 0012, or not known)
    max_new_tokens: Mapped[int | None] = mapped_column(Integer)
    # how the category was set: "given" by the caller, "auto" by the categoriser, "default"
    category_source: Mapped[str] = mapped_column(String(16), default="given",
                                                 server_default="given")
    features: Mapped[bytes | None]  # hashed prompt-token n-grams (autospec.categorize.categorizer)
    predicted_alpha: Mapped[float | None]  # the categoriser's acceptance forecast
    # batched speculation (0004): rows of the batch the request ran in; its forwards at
    # batch > 1 (kept out of target_s_by_n, which is batch 1's curve)
    batch_size: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    target_s_by_bn: Mapped[dict[str, list[float]] | None] = mapped_column(JSON)  # "B,n" → [s]
    draft_s_by_b: Mapped[dict[str, list[float]] | None] = mapped_column(JSON)  # "B" → [s/token]
    # the execution path its forwards ran on (0005; NULL: unknown, logged before 0005)
    path: Mapped[str | None] = mapped_column(String(64))
    # per iteration who drafted: the index of its proposer among the request's, sorted by
    # name, 1-based (0: nobody, a plain step); NULL: every iteration the model's or plain
    proposer_schedule: Mapped[bytes | None]
    # the draft model's catch-up forwards (0007): [[tokens, seconds], ...]; NULL: not recorded
    draft_catch_ups: Mapped[list[list[float]] | None] = mapped_column(JSON)
    # the policy's decision records of the kept iterations (0009; NULL: none kept, or logged
    # before 0009): one zlib-compressed JSON array (store.decisions, policies.explain)
    decisions: Mapped[bytes | None]
    # the rows of one batched generate call share it (0011; NULL: batch 1, or before 0011)
    batch_id: Mapped[str | None] = mapped_column(String(32))


class RequestProposer(Base):
    """One proposer's share of one request (0011): the rows of a request, by proposer name."""

    __tablename__ = "request_proposers"

    request_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("requests.id", name="fk_request_proposers_request",
                               ondelete="CASCADE"), primary_key=True)
    proposer: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # "model" or "lookup"
    blocks: Mapped[int] = mapped_column(Integer, default=0)
    proposed: Mapped[int] = mapped_column(Integer, default=0)
    accepted: Mapped[int] = mapped_column(Integer, default=0)
    proposed_per_position: Mapped[list[int]] = mapped_column(JSON)
    accepted_per_position: Mapped[list[int]] = mapped_column(JSON)
    seconds: Mapped[float] = mapped_column(default=0.0)  # host seconds proposing
    # what its replay rule reads (its own encoding; NULL: not recorded)
    trace: Mapped[bytes | None]
    confidence: Mapped[bytes | None]  # the model's top probability per generated position
    settings: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # e.g. prompt lookup's n


class CategoryStat(Base):
    """Sums over every request of one (category, pair); means and rates are derived on read."""

    __tablename__ = "category_stats"

    category_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    pair_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("pairs.id", name="fk_category_stats_pair"), primary_key=True)
    category: Mapped[str] = mapped_column(Text)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    new_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    iterations: Mapped[int] = mapped_column(BigInteger, default=0)
    draft_s: Mapped[float] = mapped_column(default=0.0)
    draft_forwards: Mapped[int] = mapped_column(BigInteger, default=0)
    target_s_sum_by_n: Mapped[dict[str, float]] = mapped_column(JSON)  # "n" → Σ seconds
    target_count_by_n: Mapped[dict[str, int]] = mapped_column(JSON)  # "n" → forwards
    k_counts: Mapped[dict[str, int]] = mapped_column(JSON)  # "k" → iterations run with k
    wall_s: Mapped[float] = mapped_column(default=0.0)
    prefill_s: Mapped[float] = mapped_column(default=0.0)
    # achieved bandwidth weighted by target-forward time: Σ bw·T and Σ T over the requests
    # that measured it, so bandwidth_bytes / bandwidth_s = bytes moved per second overall
    bandwidth_bytes: Mapped[float] = mapped_column(default=0.0)
    bandwidth_s: Mapped[float] = mapped_column(default=0.0)
    bandwidth_peak_bytes_per_s: Mapped[float | None]  # the device's peak (largest seen)
    nvml_mem_busy_sum: Mapped[float] = mapped_column(default=0.0)  # Σ per-request means, %
    nvml_mem_busy_n: Mapped[int] = mapped_column(BigInteger, default=0)
    nvml_sm_util_sum: Mapped[float] = mapped_column(default=0.0)
    nvml_sm_util_n: Mapped[int] = mapped_column(BigInteger, default=0)
    first_seen: Mapped[datetime]
    last_seen: Mapped[datetime]


class CategoryProposer(Base):
    """One proposer's sums over every request of one (category, pair) (0011)."""

    __tablename__ = "category_proposers"

    category_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    pair_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("pairs.id", name="fk_category_proposers_pair"), primary_key=True)
    proposer: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    blocks: Mapped[int] = mapped_column(BigInteger, default=0)
    proposed: Mapped[int] = mapped_column(BigInteger, default=0)
    accepted: Mapped[int] = mapped_column(BigInteger, default=0)
    proposed_per_position: Mapped[list[int]] = mapped_column(JSON)  # summed elementwise
    accepted_per_position: Mapped[list[int]] = mapped_column(JSON)
    seconds: Mapped[float] = mapped_column(default=0.0)


class PairCost(Base):
    """Batch-1 timing sums of one (pair, execution path): the cost curve T_t(n) and T_d of
    that path, pooled over every category's requests (0010: costs are the pair's, once)."""

    __tablename__ = "pair_costs"

    pair_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("pairs.id", name="fk_pair_costs_pair"), primary_key=True)
    path: Mapped[str] = mapped_column(String(64), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    draft_s: Mapped[float] = mapped_column(default=0.0)
    draft_forwards: Mapped[int] = mapped_column(BigInteger, default=0)
    target_s_sum_by_n: Mapped[dict[str, float]] = mapped_column(JSON)  # "n" → Σ seconds
    target_count_by_n: Mapped[dict[str, int]] = mapped_column(JSON)  # "n" → forwards
    last_seen: Mapped[datetime]


class CategoryPath(Base):
    """The batch-1 requests of one (category, pair) per execution path they ran on (0010; no
    timings: those are the pair's, ``pair_costs``): which path serves a category."""

    __tablename__ = "category_paths"

    category_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    pair_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("pairs.id", name="fk_category_paths_pair"), primary_key=True)
    path: Mapped[str] = mapped_column(String(64), primary_key=True)
    category: Mapped[str] = mapped_column(Text)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    last_seen: Mapped[datetime]


class Probe(Base):
    __tablename__ = "probes"
    __table_args__ = (Index("ix_probes_pair_created", "pair_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    pair_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("pairs.id", name="fk_probes_pair"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    # the batch dimension (0004): T_t(B, n) and T_d(B); None for probes at batch 1 only
    grid: Mapped[dict[str, dict[str, float]] | None] = mapped_column(JSON)  # "B" → {"n": s}
    draft_grid: Mapped[dict[str, float] | None] = mapped_column(JSON)  # "B" → s
    # the execution path it timed (0005; NULL: a probe from before 0005, which timed bare
    # eager forwards without the loop's logits processing and verification: no path's costs)
    path: Mapped[str | None] = mapped_column(String(64))


class TunedParams(Base):
    """One tuning result; the newest row per (category, pair) is the one in force."""

    __tablename__ = "tuned_params"
    __table_args__ = (
        Index("ix_tuned_params_category_pair_created", "category_key", "pair_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    category: Mapped[str] = mapped_column(Text)
    category_key: Mapped[str] = mapped_column(String(64))
    pair_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("pairs.id", name="fk_tuned_params_pair"))
    family: Mapped[str] = mapped_column(Text)  # the policy family, e.g. "costmodel"
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    tokens_per_s: Mapped[float]  # simulated on the tuning window
    baseline_tokens_per_s: Mapped[float | None]  # the untuned default, same window
    provenance: Mapped[dict[str, Any]] = mapped_column(JSON)


class Categorizer(Base):
    __tablename__ = "categorizers"
    __table_args__ = (
        Index("ix_categorizers_name_version", "name", "version", unique=True),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    name: Mapped[str] = mapped_column(Text)
    version: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32))  # "classifier" or "clusters"
    payload: Mapped[bytes]  # numpy .npz of the fitted coefficients
    meta: Mapped[dict[str, Any]] = mapped_column(JSON)
