"""Reading the store over time and by mode: what ``autospec report`` adds to the summaries.

Every function takes a session (the caller owns it) and aggregates in SQL, so memory stays
bounded however many requests the store holds; only ``recent_activity`` reads rows, and at
most ``limit`` of them. SQLite and PostgreSQL both work (time buckets are integer divisions
of Unix seconds, written per dialect).

- ``plain_vs_speculative``: per (category, pair), the requests decoded plainly (nothing
  drafted by either proposer) against those that drafted, each as total new
  tokens over total wall time — the token-weighted (harmonic) mean of the per-request rates.
- ``alpha_over_time``: accepted / drafted per time bucket (SQL ``GROUP BY`` on the bucket).
- ``recent_activity``: the policies and k of the latest requests (the policy in force).
- ``forward_spread``: how much the latest requests' T_t(n) forwards scatter (the summaries
  keep only sums and counts), read from at most ``limit`` rows.
- ``lookup_profile``: what a lookup proposer would have done on the latest greedy requests,
  from its traces (read by its own replay rule, ``autospec.engine.proposers``): how often it
  had a draft, how long it was, and how far the output agreed with it.
- ``ingested_acceptance``: the acceptance counters of the records ``autospec ingest`` wrote
  (an engine's scrapes), per engine, so the report can set an engine's acceptance by position
  beside autospec's own for the same category. It reads those records only (one per ingested
  scrape), streaming.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    Integer,
    case,
    cast,
    exists,
    func,
    literal_column,
    or_,
    select,
)
from sqlalchemy.orm import Session, aliased

from autospec.traces import TRACE_GREEDY, UNOBSERVED

from .damage import note, request_note, request_problem
from .tables import Request, RequestProposer
from .write import category_key

__all__ = ["Rate", "ModeRates", "TimeBucket", "RecentActivity", "plain_vs_speculative",
           "alpha_over_time", "recent_activity", "bucket_seconds", "BUCKET_SIZES",
           "ForwardSpread", "forward_spread", "LookupProfile", "lookup_profile",
           "fixed_block_acceptance",
           "IngestedAcceptance", "ingested_acceptance", "INGESTED"]

INGESTED = "ingested"  # the stop_reason of a record ``autospec ingest`` wrote (no request)

# bucket sizes ``bucket_seconds`` chooses from: 1 min … 30 days
BUCKET_SIZES = (60, 300, 900, 3600, 3 * 3600, 6 * 3600, 86400, 7 * 86400, 30 * 86400)


@dataclass(frozen=True)
class Rate:
    """Requests of one mode: counts and totals; tokens/s = Σ new tokens / Σ wall seconds."""

    requests: int
    new_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None


@dataclass(frozen=True)
class ModeRates:
    plain: Rate | None  # every iteration at k = 0 (nothing drafted)
    speculative: Rate | None  # at least one drafting iteration


def _filtered(stmt, category: str | None, pair_id: int | None, batch_size: int | None = None):
    if batch_size is not None:
        stmt = stmt.where(Request.batch_size == batch_size)
    if category is not None:
        stmt = stmt.where(Request.category_key == category_key(category))
    if pair_id is not None:
        stmt = stmt.where(Request.pair_id == pair_id)
    return stmt


def plain_vs_speculative(session: Session, category: str | None = None,
                         pair_id: int | None = None, batch_size: int | None = 1, *,
                         by_path: bool = False) -> dict[tuple, ModeRates]:
    """Per (category_key, pair_id): plain and speculative request totals (one GROUP BY).
    ``by_path``: per (category_key, pair_id, path) instead (path None: unknown, logged before
    0005) — plain requests on one execution path against speculative ones on another would
    credit speculation with the path's speed, so the report compares within a path.

    A request is plain when none of its proposers proposed a token (counting only the draft
    model's would put a prompt-lookup request's speed on the plain side).
    ``batch_size``: only requests
    that ran at that batch size (default 1; None: all). A row of a batched call shares its
    forwards and its wall time with the other rows, so its tokens/s is not comparable with a
    batch-1 request's: mixing them would credit or blame speculation for the batch size."""
    proposed = exists().where(RequestProposer.request_id == Request.id,
                              RequestProposer.proposed > 0)
    plain = case((proposed, 0), else_=1).label("plain")
    keys = (Request.category_key, Request.pair_id, *((Request.path,) if by_path else ()))
    stmt = _filtered(select(*keys, plain, func.count(), func.sum(Request.new_tokens),
                            func.sum(Request.wall_s)), category, pair_id, batch_size)
    stmt = stmt.group_by(*keys, plain)
    modes: dict[tuple, dict[int, Rate]] = {}
    for *key, is_plain, n, tokens, wall in session.execute(stmt):
        key[1] = int(key[1])
        modes.setdefault(tuple(key), {})[int(is_plain)] = Rate(
            int(n), int(tokens or 0), float(wall or 0.0))
    return {k: ModeRates(v.get(1), v.get(0)) for k, v in modes.items()}


@dataclass(frozen=True)
class TimeBucket:
    start: datetime  # aware UTC; the bucket covers [start, start + bucket_s)
    requests: int
    new_tokens: int
    drafted: int
    accepted: int

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def bucket_seconds(first: datetime, last: datetime, max_buckets: int = 48) -> int:
    """The smallest of ``BUCKET_SIZES`` that covers [first, last] in ≤ ``max_buckets``."""
    span = max(0.0, (last - first).total_seconds())
    for size in BUCKET_SIZES:
        if span / size < max_buckets:
            return size
    return BUCKET_SIZES[-1]


def _bucket_expr(dialect: str, bucket_s: int):
    """floor(Unix seconds of created_at / bucket_s), as an integer, in the dialect's SQL.
    The size is inlined, not bound: PostgreSQL matches GROUP BY to the SELECT expression
    textually, and two bind parameters would not match."""
    size = literal_column(str(int(bucket_s)))
    if dialect == "postgresql":
        epoch = func.extract("epoch", Request.created_at)
        return cast(func.floor(epoch / size), BigInteger)
    # SQLite keeps naive UTC text ("YYYY-MM-DD HH:MM:SS.ffffff"); strftime('%s') reads it
    # as UTC. Both operands integers: "/" divides integers (floor for non-negative times).
    epoch = cast(func.strftime("%s", Request.created_at), Integer)
    return epoch.op("/")(size)


def alpha_over_time(session: Session, category: str | None = None, pair_id: int | None = None,
                    bucket_s: int = 3600) -> list[TimeBucket]:
    """Acceptance per time bucket, oldest first; buckets without requests are absent, and so
    are requests with more tokens accepted than drafted (damaged rows)."""
    if bucket_s < 1:
        raise ValueError("bucket_s must be >= 1")
    dialect = session.get_bind().dialect.name
    bucket = _bucket_expr(dialect, int(bucket_s)).label("bucket")
    model = aliased(RequestProposer)
    stmt = _filtered(select(bucket, func.count(), func.sum(Request.new_tokens),
                            func.sum(model.proposed), func.sum(model.accepted)),
                     category, pair_id)
    # the model proposer's acceptance (the draft model's; none, counting the requests and
    # their tokens, where the request had no model). A request with a damaged proposer row
    # (more accepted than proposed, written by an older release or by hand) is not counted:
    # the summaries leave it out whole and say which
    stmt = stmt.outerjoin(model, (model.request_id == Request.id) & (model.kind == "model"))
    damaged = exists().where(RequestProposer.request_id == Request.id,
                             or_(RequestProposer.accepted < 0,
                                 RequestProposer.accepted > RequestProposer.proposed))
    stmt = stmt.where(~damaged).group_by(bucket).order_by(bucket)
    return [TimeBucket(datetime.fromtimestamp(int(b) * bucket_s, timezone.utc), int(n),
                       int(tok or 0), int(dr or 0), int(acc or 0))
            for b, n, tok, dr, acc in session.execute(stmt) if b is not None]


@dataclass(frozen=True)
class RecentActivity:
    """The latest requests of a workload: which policies served them, with which k."""

    requests: int
    since: datetime | None  # the oldest of them
    policies: dict[str, int]  # policy name → requests, most first
    k_counts: dict[int, int]  # k → iterations

    @property
    def k_mode(self) -> int | None:
        """The k run most often (ties: the larger)."""
        if not self.k_counts:
            return None
        return max(self.k_counts, key=lambda k: (self.k_counts[k], k))


def recent_activity(session: Session, category: str | None = None, pair_id: int | None = None,
                    limit: int = 200, batch_size: int | None = 1) -> RecentActivity:
    """Policies and k of the latest ``limit`` requests (reads at most ``limit`` rows) at
    ``batch_size`` (default 1, where one k is the workload's own choice; at batch > 1 the
    batch's mix sets k, shown per batch size by the report; None: every batch size)."""
    stmt = _filtered(select(Request.policy, Request.k_schedule, Request.created_at),
                     category, pair_id, batch_size)
    stmt = stmt.order_by(Request.created_at.desc(), Request.id.desc()).limit(limit)
    policies: Counter[str] = Counter()
    ks: Counter[int] = Counter()
    n, since = 0, None
    for policy, k_schedule, created in session.execute(stmt):
        n += 1
        policies[policy] += 1
        ks.update(bytes(k_schedule))
        since = created
    return RecentActivity(n, since, dict(policies.most_common()), dict(sorted(ks.items())))


@dataclass(frozen=True)
class ForwardSpread:
    """The target forwards scoring n tokens that the latest requests timed."""

    requests: int  # the requests they come from
    forwards: int
    mean_s: float
    sd_s: float | None  # sample standard deviation; None below two forwards


def forward_spread(session: Session, category: str | None = None, pair_id: int | None = None,
                   limit: int = 2000, batch_size: int | None = 1) -> dict[int, ForwardSpread]:
    """n → the spread of the T_t(n) forwards of the latest ``limit`` requests at
    ``batch_size`` (their ``target_s_by_n``; reads at most ``limit`` rows)."""
    stmt = _filtered(select(Request.target_s_by_n), category, pair_id, batch_size)
    stmt = stmt.order_by(Request.created_at.desc(), Request.id.desc()).limit(limit)
    times: dict[int, list[float]] = {}
    requests: Counter[int] = Counter()
    for (by_n,) in session.execute(stmt):
        for n, ts in (by_n or {}).items():
            ts = [float(t) for t in ts if t is not None and math.isfinite(float(t))]
            if ts:
                times.setdefault(int(n), []).extend(ts)
                requests[int(n)] += 1
    out = {}
    for n, ts in sorted(times.items()):
        mean = math.fsum(ts) / len(ts)
        sd = (math.sqrt(math.fsum((t - mean) ** 2 for t in ts) / (len(ts) - 1))
              if len(ts) > 1 else None)
        out[n] = ForwardSpread(requests[n], len(ts), mean, sd)
    return out


@dataclass(frozen=True)
class LookupProfile:
    """A lookup proposer over the latest greedy requests' traces: at each generated position
    where it had a draft, how many tokens the draft held and how many of them the output
    agreed with; and the same requests' model trace (the draft model's acceptance there)."""

    requests: int
    positions: int  # generated positions their traces cover
    cells: Counter  # (agreeing tokens, draft length) → positions where it had a draft
    draft_observed: int = 0  # the same requests' model traces: positions observed
    draft_matched: int = 0  # … where the draft's token was the target's

    @property
    def matched(self) -> int:
        return sum(self.cells.values())

    @property
    def match_rate(self) -> float | None:
        return self.matched / self.positions if self.positions else None

    @property
    def draft_alpha(self) -> float | None:
        """The draft model's acceptance on these requests, from its trace (any k ran)."""
        return self.draft_matched / self.draft_observed if self.draft_observed else None

    def conditional(self, k_max: int = 16) -> list[float | None]:
        """P(proposed token i accepted | the i − 1 before it were), i = 1 … k_max, where it
        had a draft that long: under greedy verification a block accepts its agreeing prefix."""
        out: list[float | None] = []
        for i in range(k_max):
            reached = sum(c for (a, n), c in self.cells.items() if a >= i and n > i)
            out.append(sum(c for (a, n), c in self.cells.items() if a > i and n > i) / reached
                       if reached else None)
        return out

    def block(self, k: int, cost) -> tuple[float, float]:
        """(E[tokens], E[seconds of the target]) of its block of at most k tokens where it has
        a draft: it holds min(k, length) tokens and, under greedy verification, accepts
        min(agreement, k) of them plus the token the target adds; the target scores the block
        and that token (``cost(n)``: T_t(n))."""
        n = self.matched
        if not n:
            return 1.0, cost(1)
        tokens = seconds = 0.0
        for (agree, length), c in self.cells.items():
            width = min(k, length)
            tokens += (min(agree, width) + 1) * c
            seconds += cost(width + 1) * c
        return tokens / n, seconds / n


def fixed_block_acceptance(rows, k_max: int = 16, limit: int = 200) -> list[float | None]:
    """The draft model's acceptance by position in a block of fixed length k with no early
    stop — what an engine's fixed ``num_speculative_tokens`` accepts — from the model traces
    of the latest ``limit`` greedy batch-1 rows of ``rows`` (``TraceRow``s, newest last).
    Greedy verification accepts a block's agreeing prefix, and the draft continues from the
    target's own tokens while it agrees, so a block started at position g accepts the run of
    agreeing positions from g: P(token i accepted | the i − 1 before it were), i = 1 …
    ``k_max``, is (runs longer than i − 1 that agree at i) / (runs longer than i − 1 whose
    i-th position was observed). A run cut by an unobserved position (or the request's end)
    counts up to where it was seen. The live blocks' acceptance is not this: the early stop
    ends a block where the draft is unsure, so its later positions are the confident ones.
    None at a position no run reached."""
    mine = [r for r in rows if r.trace_kind == TRACE_GREEDY and r.batch_size == 1][-limit:]
    reached, agreed = [0] * k_max, [0] * k_max
    for row in mine:
        run, cut = 0, True  # from the end backward: the run from g, and whether it was cut
        for v in reversed(row.trace):
            if v == UNOBSERVED:
                run, cut = 0, True
                continue
            if v == 1:
                run += 1
            else:
                run, cut = 0, False
            for i in range(min(run, k_max)):  # tokens 1 … run agree
                reached[i] += 1
                agreed[i] += 1
            if not cut and run < k_max:  # token run + 1 observed not to
                reached[run] += 1
    return [a / n if n else None for a, n in zip(agreed, reached)]


def lookup_profile(rows, proposer: str, replay, limit: int = 200) -> LookupProfile | None:
    """The profile of ``proposer`` over the greedy batch-1 rows of ``rows`` (the store's
    ``TraceRow``s, newest last) that carry its trace, the latest ``limit`` of them;
    ``replay``: its class's replay rule (``Proposer.replay``), whose ``read(g)`` gives
    (match, agreeing tokens, draft length) per position. None where none carries one.
    Sampled requests are left out: their trace counts agreement with what was sampled, not
    what the rule would have accepted."""
    mine = [r for r in rows if r.trace_kind == TRACE_GREEDY and r.batch_size == 1
            and proposer in r.traces][-limit:]
    n = positions = observed = right = 0
    cells: Counter = Counter()
    for row in mine:
        rule = replay(row)
        if rule is None:
            continue
        n += 1
        for v in row.trace:
            if v != UNOBSERVED:
                observed += 1
                right += v == 1
        for g in range(row.new_tokens or len(row.trace)):
            positions += 1
            got = rule.read(g)
            if got is not None and got[0]:
                cells[(got[1], got[2])] += 1
    return LookupProfile(n, positions, cells, observed, right) if n else None


@dataclass(frozen=True)
class IngestedAcceptance:
    """One engine's ingested scrapes for a category and pair, summed."""

    source: str  # the record's policy: "<engine> (ingested)"
    records: int  # ingested scrapes
    new_tokens: int
    drafts: int
    drafted: int
    accepted: int
    accepted_per_position: tuple[int, ...]
    drafted_per_position: tuple[int, ...]


def ingested_acceptance(session: Session, category: str | None = None,
                        pair_id: int | None = None) -> list[IngestedAcceptance]:
    """Per source (the records' policy, e.g. "vllm (ingested)"), the counters of the records
    that ``autospec ingest`` wrote, in order of first ingest; [] where there are none. A
    record whose counters are not a rate in [0, 1] (``damage.request_problem``: written before
    ingest refused them, or by hand) is left out and noted."""
    model = RequestProposer
    stmt = _filtered(select(Request.id, Request.category, Request.pair_id, Request.policy,
                            Request.new_tokens, model), category, pair_id)
    stmt = stmt.join(model, (model.request_id == Request.id) & (model.kind == "model"))
    stmt = stmt.where(Request.stop_reason == INGESTED).order_by(Request.id)
    sums: dict[str, list] = {}
    for rid, cat, pid, policy, new, m in session.execute(stmt):
        problem = request_problem(m)  # the text every reader says of this row
        if problem is not None:
            note(request_note(rid, cat, pid, policy, problem))
            continue
        drafts, drafted, accepted = m.blocks, m.proposed, m.accepted
        acc_pos, dr_pos = m.accepted_per_position, m.proposed_per_position
        row = sums.setdefault(policy, [0, 0, 0, 0, 0, Counter(), Counter()])
        row[0] += 1
        row[1] += new or 0
        row[2] += drafts or 0
        row[3] += drafted or 0
        row[4] += accepted or 0
        row[5].update(dict(enumerate(acc_pos or [])))
        row[6].update(dict(enumerate(dr_pos or [])))
    out = []
    for policy, (n, new, drafts, drafted, accepted, acc_pos, dr_pos) in sums.items():
        width = max([*acc_pos, *dr_pos], default=-1) + 1
        out.append(IngestedAcceptance(policy, n, new, drafts, drafted, accepted,
                                      tuple(acc_pos[i] for i in range(width)),
                                      tuple(dr_pos[i] for i in range(width))))
    return out
