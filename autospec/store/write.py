"""Writing records: validation, pair rows, request rows and the running category statistics.

These functions take a session and never commit: the caller owns the transaction (the
background writer runs one per batch). ``write_records`` inserts the request rows and folds
them into ``category_stats`` in that same transaction, so the statistics always equal the sums
over the committed requests.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from autospec.textfmt import clip
from autospec.traces import trace_length_problem

from .damage import rate_problem, trace_problem
from .decisions import check as check_decisions
from .decisions import pack as pack_decisions
from .record import (
    CATEGORY_SOURCES,
    PROPOSER_KINDS,
    TRACE_GREEDY,
    TRACE_SAMPLED,
    PairInfo,
    ProposerRecord,
    RequestRecord,
    check_category,
    check_proposer_name,
)
from .tables import (
    Categorizer,
    CategoryPath,
    CategoryProposer,
    CategoryStat,
    Pair,
    PairCost,
    Probe,
    Request,
    RequestProposer,
    TunedParams,
    utcnow,
)

__all__ = [
    "category_key",
    "check_path",
    "add_engine_steps",
    "validate_record",
    "get_or_create_pair",
    "write_records",
    "add_probe",
    "add_tuned_params",
    "add_categorizer",
]

_COUNTERS = ("prompt_tokens", "new_tokens", "iterations", "draft_forwards")
_OPTIONAL_FLOATS = ("bandwidth_bytes_per_s", "bandwidth_peak_bytes_per_s",
                    "nvml_mem_busy_pct", "nvml_sm_util_pct", "predicted_alpha")
# a proposer's counters, summed per (category, pair, proposer)
_PROPOSER_SUMS = ("blocks", "proposed", "accepted", "seconds")


def category_key(category: str) -> str:
    """The fixed-length key categories are indexed on: SHA-256 of the UTF-8 text."""
    return hashlib.sha256(category.encode("utf-8")).hexdigest()


def pair_key(pair: PairInfo) -> str:
    parts = (pair.target, pair.draft, pair.dtype, pair.hardware)
    return hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()


def check_path(path: object) -> str | None:
    """An execution path as the store keeps it (``autospec.engine.runners.path_name``: "eager",
    "static", "static+cuda-graphs", or "target/draft"), or None for unknown."""
    if path is None:
        return None
    if not isinstance(path, str) or not path or len(path) > 64 or not path.isprintable():
        raise ValueError(f"path must be a short printable string such as 'eager' or "
                         f"'static', or None (unknown), got {path!r}")
    return path


def _clean_text(text: str | None) -> str | None:
    """Free text that every backend can store: NUL becomes U+FFFD, lone surrogates "?"."""
    if text is None:
        return None
    text = str(text).replace("\x00", "\ufffd")
    return text.encode("utf-8", "replace").decode("utf-8") if not text.isascii() else text


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and non-negative, got {value!r}")
    return float(value)


def _blob(name: str, value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"{name} must be bytes, got {type(value).__name__}")
    return bytes(value)


def validate_record(rec: RequestRecord) -> RequestRecord:
    """A normalised copy of ``rec`` (bytes are bytes, ints are ints), or ValueError saying
    which field is wrong. Called before anything touches the database. A record's deferred
    work (``finish``) runs here first, once; the copy has none left. Its failure is a
    ValueError too: the record is invalid (the writer counts it, ``Store.write`` raises)."""
    try:
        return _validated(_finished(rec))
    except (TypeError, AttributeError) as exc:  # e.g. None where a list belongs
        raise ValueError(f"malformed RequestRecord: {exc}") from None


def _finished(rec: RequestRecord) -> RequestRecord:
    """``rec`` after its deferred work (``RequestRecord.finish``, then each proposer's trace
    given as a callable), if any."""
    work = rec.finish if isinstance(rec, RequestRecord) else None
    try:
        if work is not None:
            done = work(rec)
            rec = rec if done is None else done
        proposers = getattr(rec, "proposers", None)
        if isinstance(proposers, Mapping) and any(
                callable(getattr(p, "trace", None)) for p in proposers.values()):
            rec = replace(rec, proposers={
                name: replace(p, trace=p.trace()) if callable(getattr(p, "trace", None)) else p
                for name, p in proposers.items()})
    except Exception as exc:
        raise ValueError(f"the record's deferred work failed: {type(exc).__name__}: "
                         f"{exc}") from exc
    return rec


def _proposer(name: str, p: object, positions: int) -> ProposerRecord:
    """A record's proposer row, checked and normalised: its name and kind, its counters a
    rate (``damage.rate_problem``), its trace so many bytes per generated position, its
    confidence one byte per position, its settings a dict."""
    check_proposer_name(name)
    if not isinstance(p, ProposerRecord):
        raise ValueError(f"proposers[{name!r}] must be a ProposerRecord, got "
                         f"{type(p).__name__}")
    if p.kind not in PROPOSER_KINDS:
        raise ValueError(f"proposers[{name!r}].kind must be one of {PROPOSER_KINDS}, "
                         f"got {p.kind!r}")
    counts = {f: _count(f"proposers[{name!r}].{f}", getattr(p, f))
              for f in ("blocks", "proposed", "accepted")}
    lists = {f: [_count(f"proposers[{name!r}].{f}[{i}]", v)
                 for i, v in enumerate(getattr(p, f) or ())]
             for f in ("proposed_per_position", "accepted_per_position")}
    problem = rate_problem(counts["proposed"], counts["accepted"],
                           lists["accepted_per_position"], lists["proposed_per_position"],
                           who=f"{name} ")
    if problem is not None:
        raise ValueError(f"the record's counters contradict each other: {problem}")
    trace = None if p.trace is None else _blob(f"proposers[{name!r}].trace", p.trace)
    problem = None if trace is None else trace_problem(len(trace), positions)
    if problem is not None:  # its length: what every replay rule reads per position
        raise ValueError(f"proposers[{name!r}].trace {problem} (None: not recorded)")
    problem = None if trace is None else _trace_problem(name, trace, positions)
    if problem is not None:  # its encoding, by its proposer's own rule
        raise ValueError(f"proposers[{name!r}].trace is not a {name} trace of this request: "
                         f"{problem}")
    confidence = (None if p.confidence is None
                  else _blob(f"proposers[{name!r}].confidence", p.confidence))
    if confidence is not None and len(confidence) != positions:
        raise ValueError(f"proposers[{name!r}].confidence has {len(confidence)} bytes for "
                         f"{positions} generated positions: one per position")
    if p.settings is not None and not isinstance(p.settings, Mapping):
        raise ValueError(f"proposers[{name!r}].settings must be a dict or None, got "
                         f"{type(p.settings).__name__}")
    if p.settings is not None:
        try:  # checked here: a value no backend can store would fail the writer's whole batch
            json.dumps(dict(p.settings), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"proposers[{name!r}].settings must be JSON (strings, finite "
                             f"numbers, lists, dicts): {exc}") from None
    return ProposerRecord(kind=p.kind, **counts, **lists,
                          seconds=_seconds(f"proposers[{name!r}].seconds", p.seconds),
                          trace=trace, confidence=confidence,
                          settings=None if p.settings is None else dict(p.settings))


def _trace_problem(name: str, trace: bytes, positions: int) -> str | None:
    """What its proposer's own rule finds wrong with a trace (``Proposer.trace_problem``: its
    encoding's length and values), where ``name`` is registered in this process (its
    registry loaded: where the engine made the record); else a whole number of bytes per
    generated position. Empty is left to ``damage.trace_problem``."""
    if not trace:
        return None
    # the registry as this process has it, never imported here: the engine (and torch) is
    # loaded wherever a record with a trace was made, and importing torch from the writer's
    # flush at interpreter exit can crash the interpreter
    engine = sys.modules.get("autospec.engine.proposers")
    cls = engine.registered().get(name) if engine is not None else None
    return cls.trace_problem(trace, positions) if cls is not None else trace_length_problem(
        trace, positions)


def _schedule(rec: RequestRecord, names: Sequence[str]) -> bytes | None:
    """``rec.proposer_schedule`` (a name or None per iteration) as the store keeps it: the
    index of each name among ``names`` (sorted), 1-based, 0 for a plain step; None where it
    is absent."""
    sched = rec.proposer_schedule
    if sched is None:
        return None
    if not isinstance(sched, (list, tuple)) or not all(
            p is None or isinstance(p, str) for p in sched):
        raise ValueError(f"proposer_schedule must be a list of proposer names (None: a plain "
                         f"step), one per iteration, or None; got {clip(repr(sched), 80)}")
    if len(sched) != len(rec.k_schedule):
        raise ValueError(f"proposer_schedule must name one proposer (or None) per iteration "
                         f"({len(rec.k_schedule)}), got {len(sched)}")
    index = {n: i + 1 for i, n in enumerate(names)}
    unknown = {p for p in sched if p is not None and p not in index}
    if unknown:
        raise ValueError(f"proposer_schedule names {sorted(map(str, unknown))}, which the "
                         f"record has no counters of (it has {', '.join(names) or 'none'})")
    return bytes(0 if p is None else index[p] for p in sched)


def _validated(rec: RequestRecord) -> RequestRecord:
    if not isinstance(rec, RequestRecord):
        raise ValueError(f"expected a RequestRecord, got {type(rec).__name__}")
    if not isinstance(rec.pair, PairInfo):
        raise ValueError(f"record.pair must be a PairInfo, got {type(rec.pair).__name__}")
    for name in ("target", "draft", "dtype", "hardware"):
        value = getattr(rec.pair, name)
        if not isinstance(value, str) or not value or "\x00" in value:
            raise ValueError(f"pair.{name} must be a non-empty string without NUL, got {value!r}")
    check_category(rec.category)
    for name in _COUNTERS:
        _count(name, getattr(rec, name))
    if not isinstance(rec.proposers, Mapping):
        raise ValueError(f"proposers must be a dict of name → ProposerRecord, got "
                         f"{type(rec.proposers).__name__}")
    proposers = {name: _proposer(name, p, rec.new_tokens)
                 for name, p in sorted(rec.proposers.items())}
    if sum(p.kind == "model" for p in proposers.values()) > 1:
        raise ValueError("a request has at most one model proposer, got "
                         f"{[n for n, p in proposers.items() if p.kind == 'model']}")
    _schedule(rec, list(proposers))  # checked here, encoded by ``_request_row``
    batch_id = rec.batch_id
    if batch_id is not None and (not isinstance(batch_id, str) or not batch_id.isalnum()
                                 or len(batch_id) > 32):
        raise ValueError(f"batch_id must be up to 32 letters and digits, or None, "
                         f"got {batch_id!r}")
    if rec.trace_kind not in (TRACE_GREEDY, TRACE_SAMPLED):
        raise ValueError(f"trace_kind must be {TRACE_GREEDY!r} or {TRACE_SAMPLED!r}, "
                         f"got {rec.trace_kind!r}")
    by_n: dict[int, list[float]] = {}
    for n, times in dict(rec.target_s_by_n).items():
        n = _count("target_s_by_n key", int(n) if isinstance(n, str) and n.isdigit() else n)
        by_n[n] = [_seconds(f"target_s_by_n[{n}]", t) for t in times]
    optional = {}
    for name in _OPTIONAL_FLOATS:  # a figure that could not be measured is simply absent
        value = getattr(rec, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        optional[name] = float(value) if ok and math.isfinite(value) else None
    if not isinstance(rec.created_at, (int, float)) or not math.isfinite(rec.created_at):
        raise ValueError(f"created_at must be a Unix time, got {rec.created_at!r}")
    if rec.category_source not in CATEGORY_SOURCES:
        raise ValueError(f"category_source must be one of {CATEGORY_SOURCES}, "
                         f"got {rec.category_source!r}")
    features = None if rec.features is None else _blob("features", rec.features)
    path = check_path(rec.path)
    catch_ups = _catch_ups(rec.draft_catch_ups)
    decisions = check_decisions(rec.decisions)
    batch = rec.batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch!r}")
    limit = rec.max_new_tokens
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < max(1, rec.new_tokens)):
        raise ValueError(f"max_new_tokens must be None or an int of at least new_tokens "
                         f"({rec.new_tokens}), got {limit!r}")
    by_bn = {key: [_seconds(f"target_s_by_bn[{key}]", t) for t in times]
             for key, times in _keyed(rec.target_s_by_bn, "target_s_by_bn", 2).items()}
    by_b = {key[0]: [_seconds(f"draft_s_by_b[{key[0]}]", t) for t in times]
            for key, times in _keyed(rec.draft_s_by_b, "draft_s_by_b", 1).items()}
    return replace(
        rec, **optional, target_s_by_n=by_n, greedy=bool(rec.greedy), proposers=proposers,
        batch_size=batch, target_s_by_bn=by_bn or None, draft_s_by_b=by_b or None, path=path,
        policy=_clean_text(str(rec.policy)), stop_reason=_clean_text(rec.stop_reason or ""),
        prompt_text=_clean_text(rec.prompt_text), output_text=_clean_text(rec.output_text),
        k_schedule=_blob("k_schedule", rec.k_schedule),
        accepted_schedule=_blob("accepted_schedule", rec.accepted_schedule),
        wall_s=_seconds("wall_s", rec.wall_s), prefill_s=_seconds("prefill_s", rec.prefill_s),
        draft_s=_seconds("draft_s", rec.draft_s), features=features,
        draft_catch_ups=catch_ups, decisions=decisions, batch_id=batch_id, finish=None)


def _catch_ups(value) -> list[tuple[int, float]] | None:
    """``draft_catch_ups`` checked: (tokens, seconds) pairs, tokens a positive int."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"draft_catch_ups must be a list of (tokens, seconds), got {value!r}")
    out = []
    for i, point in enumerate(value):
        if not isinstance(point, (tuple, list)) or len(point) != 2:
            raise ValueError(f"draft_catch_ups[{i}] must be (tokens, seconds), got {point!r}")
        tokens = point[0]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"draft_catch_ups[{i}] tokens must be a positive int, "
                             f"got {tokens!r}")
        out.append((tokens, _seconds(f"draft_catch_ups[{i}]", point[1])))
    return out


def _keyed(mapping: Mapping | None, name: str, arity: int) -> dict[tuple[int, ...], Any]:
    """Keys of the batch timings as int tuples: (B, n) or "B,n" for ``target_s_by_bn``,
    B or "B" for ``draft_s_by_b``; every part a positive int."""
    out: dict[tuple[int, ...], Any] = {}
    for key, value in dict(mapping or {}).items():
        parts = key.split(",") if isinstance(key, str) else (
            key if isinstance(key, (tuple, list)) else (key,))
        try:
            ints = tuple(int(p) for p in parts)
        except (TypeError, ValueError):
            ints = ()
        bad = any(isinstance(p, (bool, float)) for p in parts)
        if bad or len(ints) != arity or min(ints) < 1:
            raise ValueError(f"{name} keys must be {'(B, n)' if arity == 2 else 'B'} "
                             f"(positive ints), got {key!r}")
        out[ints] = value
    return out


def _insert_ignoring_conflict(session: Session, model: type, values: dict[str, Any],
                              keys: Sequence[str]) -> None:
    """INSERT … ON CONFLICT DO NOTHING where the dialect has it, else a savepoint."""
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        else:
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        stmt = dialect_insert(model).values(**values).on_conflict_do_nothing(index_elements=keys)
        session.execute(stmt)
        return
    try:
        with session.begin_nested():
            session.execute(insert(model).values(**values))
    except IntegrityError:
        pass


def get_or_create_pair(session: Session, pair: PairInfo) -> int:
    """The id of ``pair``'s row, inserting it if new (safe against concurrent writers)."""
    key = pair_key(pair)
    pid = session.scalar(select(Pair.id).where(Pair.key == key))
    if pid is None:
        _insert_ignoring_conflict(session, Pair, dict(
            key=key, target=pair.target, draft=pair.draft, dtype=pair.dtype,
            hardware=pair.hardware, target_param_bytes=int(pair.target_param_bytes),
            draft_param_bytes=int(pair.draft_param_bytes), created_at=utcnow()), ["key"])
        pid = session.scalar(select(Pair.id).where(Pair.key == key))
    return int(pid)


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


def _request_row(rec: RequestRecord, pair_id: int) -> dict[str, Any]:
    row = {name: getattr(rec, name) for name in (
        *_COUNTERS, *_OPTIONAL_FLOATS, "category", "policy", "greedy", "k_schedule",
        "accepted_schedule", "trace_kind", "wall_s", "prefill_s", "draft_s", "prompt_text",
        "output_text", "stop_reason", "category_source", "features", "path", "batch_id",
        "max_new_tokens")}
    row["proposer_schedule"] = _schedule(rec, sorted(rec.proposers))
    row["decisions"] = pack_decisions(rec.decisions)
    row["draft_catch_ups"] = (None if rec.draft_catch_ups is None
                              else [[g, c] for g, c in rec.draft_catch_ups])
    row.update(pair_id=pair_id, category_key=category_key(rec.category),
               created_at=_utc(rec.created_at),
               target_s_by_n={str(n): ts for n, ts in sorted(rec.target_s_by_n.items())},
               batch_size=rec.batch_size,
               target_s_by_bn=None if not rec.target_s_by_bn else {
                   f"{b},{n}": ts for (b, n), ts in sorted(rec.target_s_by_bn.items())},
               draft_s_by_b=None if not rec.draft_s_by_b else {
                   str(b): ts for b, ts in sorted(rec.draft_s_by_b.items())})
    return row


def _add_lists(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Elementwise sum, the shorter list padded with zeros."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _add_maps(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


@dataclass
class _Delta:
    """One batch's contribution to one category_stats row."""

    category: str
    sums: Counter = field(default_factory=Counter)
    # per proposer: (its kind, its summed counters, per position proposed and accepted)
    proposers: dict[str, tuple[str, Counter, Counter, Counter]] = field(default_factory=dict)
    target_s_sum_by_n: Counter = field(default_factory=Counter)  # n → seconds
    target_count_by_n: Counter = field(default_factory=Counter)  # n → forwards
    k_counts: Counter = field(default_factory=Counter)  # k → iterations
    peak: float | None = None
    first: float = math.inf
    last: float = -math.inf

    def add(self, rec: RequestRecord) -> None:
        """Counters are summed for every request. The timing sums (draft_s, draft_forwards,
        target_s_*_by_n) are batch 1's cost curve: a request that ran at batch > 1 keeps its
        timings in its own row (target_s_by_bn, draft_s_by_b) and adds none here."""
        sums = self.sums
        sums["requests"] += 1
        batched = rec.batch_size > 1
        for name in (*_COUNTERS, "draft_s", "wall_s", "prefill_s"):
            if not (batched and name in ("draft_s", "draft_forwards")):
                sums[name] += getattr(rec, name)
        for name, p in rec.proposers.items():
            kind, counts, proposed, accepted = self.proposers.setdefault(
                name, (p.kind, Counter(), Counter(), Counter()))
            for f in _PROPOSER_SUMS:
                counts[f] += getattr(p, f)
            proposed.update(dict(enumerate(p.proposed_per_position)))
            accepted.update(dict(enumerate(p.accepted_per_position)))
        target_s = 0.0
        for n, ts in rec.target_s_by_n.items():
            if not batched:
                self.target_s_sum_by_n[n] += sum(ts)
                self.target_count_by_n[n] += len(ts)
            target_s += sum(ts)
        target_s += sum(sum(ts) for ts in (rec.target_s_by_bn or {}).values())
        self.k_counts.update(rec.k_schedule)
        if rec.bandwidth_bytes_per_s is not None and target_s > 0:
            sums["bandwidth_bytes"] += rec.bandwidth_bytes_per_s * target_s
            sums["bandwidth_s"] += target_s
        if rec.bandwidth_peak_bytes_per_s is not None:
            self.peak = max(self.peak or 0.0, rec.bandwidth_peak_bytes_per_s)
        for name in ("nvml_mem_busy", "nvml_sm_util"):
            value = getattr(rec, f"{name}_pct")
            if value is not None:
                sums[f"{name}_sum"] += value
                sums[f"{name}_n"] += 1
        self.first = min(self.first, rec.created_at)
        self.last = max(self.last, rec.created_at)


def _list(c: Counter) -> list[int]:
    return [c[i] for i in range(max(c) + 1)] if c else []


def _map(c: Counter) -> dict[str, Any]:
    return {str(k): v for k, v in c.items()}


def _fold_stats(session: Session, pair_id: int, key: str, delta: _Delta) -> None:
    """Read-modify-write of one stats row under a row lock (FOR UPDATE; SQLite's write
    transaction already serialises writers), so concurrent writers never lose increments."""
    first, last = _utc(delta.first), _utc(delta.last)
    _insert_ignoring_conflict(session, CategoryStat, dict(
        category_key=key, pair_id=pair_id, category=delta.category, target_s_sum_by_n={},
        target_count_by_n={}, k_counts={}, first_seen=first, last_seen=last),
        ["category_key", "pair_id"])
    row, changes = _locked_row(session, CategoryStat, category_key=key, pair_id=pair_id)
    for name, value in delta.sums.items():
        changes[name] = (row[name] or 0) + value
    for name in ("target_s_sum_by_n", "target_count_by_n", "k_counts"):
        changes[name] = _add_maps(row[name] or {}, _map(getattr(delta, name)))
    if delta.peak is not None:
        changes["bandwidth_peak_bytes_per_s"] = max(row["bandwidth_peak_bytes_per_s"] or 0.0,
                                                    delta.peak)
    changes["first_seen"] = min(row["first_seen"], first)
    changes["last_seen"] = max(row["last_seen"], last)
    _write_row(session, CategoryStat, changes, category_key=key, pair_id=pair_id)
    for name, (kind, counts, proposed, accepted) in sorted(delta.proposers.items()):
        where = dict(category_key=key, pair_id=pair_id, proposer=name)
        _insert_ignoring_conflict(session, CategoryProposer, dict(
            where, kind=kind, blocks=0, proposed=0, accepted=0, proposed_per_position=[],
            accepted_per_position=[], seconds=0.0), ["category_key", "pair_id", "proposer"])
        prow, pchanges = _locked_row(session, CategoryProposer, **where)
        for f in _PROPOSER_SUMS:
            pchanges[f] = (prow[f] or 0) + counts[f]
        pchanges["proposed_per_position"] = _add_lists(prow["proposed_per_position"] or [],
                                                       _list(proposed))
        pchanges["accepted_per_position"] = _add_lists(prow["accepted_per_position"] or [],
                                                       _list(accepted))
        _write_row(session, CategoryProposer, pchanges, **where)


def _locked_row(session: Session, table, **key) -> tuple[Mapping[str, Any], dict]:
    """One row of ``table`` by its primary key, read under a row lock (FOR UPDATE; SQLite's
    write transaction already serialises writers), as a mapping, and an empty dict of
    changes. Core statements, not the ORM's unit of work: its UPDATEs are cached per mapper
    and per connection's dialect, so every store a process opened would stay in memory."""
    t = table.__table__
    stmt = select(t).where(*(t.c[name] == value for name, value in key.items()))
    return session.execute(stmt.with_for_update()).mappings().one(), {}


def _write_row(session: Session, table, changes: Mapping[str, Any], **key) -> None:
    t = table.__table__
    session.execute(update(t).where(*(t.c[name] == value for name, value in key.items()))
                    .values(**changes))


def write_records(session: Session, records: Iterable[RequestRecord],
                  pair_ids: dict[PairInfo, int] | None = None, *,
                  validated: bool = False) -> dict[PairInfo, int]:
    """Insert ``records`` and fold them into ``category_stats`` (per category), ``pair_costs``
    (batch 1's timings per (pair, path)) and ``category_paths``; does not commit.

    Raises ValueError (before any SQL) if a record is invalid, e.g. an empty category
    (``validated=True``: the caller already ran ``validate_record`` on each).
    ``pair_ids`` is a cache of known pair rows (only pass ids that are committed); returns
    the pair ids this call used, for the caller to cache once the transaction commits.
    """
    recs = list(records) if validated else [validate_record(r) for r in records]
    known = dict(pair_ids or {})
    used: dict[PairInfo, int] = {}
    # lock order: pairs, then stats rows, pair_costs rows, category_paths rows, each sorted,
    # so concurrent writers cannot deadlock
    for pair in sorted({r.pair for r in recs}, key=pair_key):
        used[pair] = known[pair] if pair in known else get_or_create_pair(session, pair)
    if not recs:
        return used
    # render_nulls: one executemany for the batch (else rows group by which values are None);
    # the ids in the records' order, for their proposers' rows
    ids = session.scalars(
        insert(Request).returning(Request.id, sort_by_parameter_order=True)
        .execution_options(render_nulls=True),
        [_request_row(r, used[r.pair]) for r in recs]).all()
    rows = [dict(request_id=rid, proposer=name, kind=p.kind, blocks=p.blocks,
                 proposed=p.proposed, accepted=p.accepted,
                 proposed_per_position=p.proposed_per_position,
                 accepted_per_position=p.accepted_per_position, seconds=p.seconds,
                 trace=p.trace, confidence=p.confidence, settings=p.settings)
            for rid, r in zip(ids, recs) for name, p in r.proposers.items()]
    if rows:
        session.execute(insert(RequestProposer).execution_options(render_nulls=True), rows)
    deltas: dict[tuple[str, int], _Delta] = {}
    for r in recs:
        k = (category_key(r.category), used[r.pair])
        deltas.setdefault(k, _Delta(r.category)).add(r)
    for (key, pid), delta in sorted(deltas.items()):
        _fold_stats(session, pid, key, delta)
    # batch 1's costs per (pair, path), every category's pooled: they are the pair's; which
    # path served each category apart. Unknown paths and batched rows add none
    costs: dict[tuple[int, str], _Delta] = {}
    served: dict[tuple[str, int, str], _Delta] = {}
    for r in recs:
        if r.path is not None and r.batch_size == 1:
            costs.setdefault((used[r.pair], r.path), _Delta("")).add(r)
            served.setdefault((category_key(r.category), used[r.pair], r.path),
                              _Delta(r.category)).add(r)
    for (pid, path), delta in sorted(costs.items()):
        _fold_costs(session, pid, path, delta)
    for (key, pid, path), delta in sorted(served.items()):
        _fold_path(session, pid, key, path, delta)
    session.flush()
    return used


def _fold_costs(session: Session, pair_id: int, path: str, delta: _Delta) -> None:
    """``_fold_stats`` for one ``pair_costs`` row: the timing sums of one (pair, path)."""
    last = _utc(delta.last)
    _insert_ignoring_conflict(session, PairCost, dict(
        pair_id=pair_id, path=path, requests=0, draft_s=0.0, draft_forwards=0,
        target_s_sum_by_n={}, target_count_by_n={}, last_seen=last), ["pair_id", "path"])
    row, changes = _locked_row(session, PairCost, pair_id=pair_id, path=path)
    changes["requests"] = (row["requests"] or 0) + delta.sums["requests"]
    changes["draft_s"] = (row["draft_s"] or 0.0) + delta.sums["draft_s"]
    changes["draft_forwards"] = (row["draft_forwards"] or 0) + delta.sums["draft_forwards"]
    for name in ("target_s_sum_by_n", "target_count_by_n"):
        changes[name] = _add_maps(row[name] or {}, _map(getattr(delta, name)))
    changes["last_seen"] = max(row["last_seen"], last)
    _write_row(session, PairCost, changes, pair_id=pair_id, path=path)


def add_engine_steps(session: Session, pair_id: int, path: str, n: int, seconds: float,
                     steps: int, created_at: float | None = None) -> None:
    """An engine's own steps into the pair's ``pair_costs`` row of ``path`` (not a path
    autospec's loop runs on: ``fleet.engine_costs.ENGINE_STEP_PATHS``): ``steps`` steps that
    scored ``n`` tokens each took ``seconds`` in all, the engine's drafting inside them. No
    request row and no ``category_paths`` row: the path serves no category."""
    path = check_path(path)
    n = _count("n", n)
    steps = _count("steps", steps)
    seconds = _seconds("seconds", seconds)
    if n < 1 or steps < 1:
        raise ValueError(f"an engine's steps need n ≥ 1 and steps ≥ 1, got n = {n}, "
                         f"steps = {steps}")
    delta = _Delta("")
    delta.sums["requests"] += 1
    delta.target_s_sum_by_n[n] += seconds
    delta.target_count_by_n[n] += steps
    delta.first = delta.last = time.time() if created_at is None else float(created_at)
    _fold_costs(session, pair_id, path, delta)
    session.flush()


def _fold_path(session: Session, pair_id: int, key: str, path: str, delta: _Delta) -> None:
    """One ``category_paths`` row: a category's batch-1 requests on one path (no timings)."""
    last = _utc(delta.last)
    _insert_ignoring_conflict(session, CategoryPath, dict(
        category_key=key, pair_id=pair_id, path=path, category=delta.category, requests=0,
        last_seen=last), ["category_key", "pair_id", "path"])
    row, changes = _locked_row(session, CategoryPath, category_key=key, pair_id=pair_id,
                               path=path)
    changes["requests"] = (row["requests"] or 0) + delta.sums["requests"]
    changes["last_seen"] = max(row["last_seen"], last)
    _write_row(session, CategoryPath, changes, category_key=key, pair_id=pair_id, path=path)


def _grid(grid: Mapping | None, name: str, depth: int) -> dict[str, Any] | None:
    """A probe grid as JSON: positive int keys as strings, finite non-negative seconds
    (``depth`` 2: B → {n: s}; 1: B → s). None for an empty or absent grid."""
    if not grid:
        return None
    out: dict[str, Any] = {}
    for key, value in sorted(_keyed(grid, name, 1).items()):
        if depth == 2:
            out[str(key[0])] = {str(n[0]): _seconds(f"{name}[{key[0]}][{n[0]}]", s)
                                for n, s in sorted(_keyed(value, name, 1).items())}
        else:
            out[str(key[0])] = _seconds(f"{name}[{key[0]}]", value)
    return out


def add_probe(session: Session, pair: PairInfo | int, payload: Mapping[str, Any]) -> int:
    """Store a hardware probe of ``pair`` (``autospec probe``); returns the probe's id.
    A payload's ``grid`` (B → {n: seconds}) and ``draft_grid`` (B → seconds) go to their
    own columns (``queries.batch_costs`` reads them), its ``path`` (the execution path it
    timed, ``ProbeResult.path``) to the path column; the rest stays the JSON payload. A
    payload without a path is stored as unknown: no path's cost query reads it."""
    pid = pair if isinstance(pair, int) else get_or_create_pair(session, pair)
    payload = dict(payload)
    grid = _grid(payload.pop("grid", None), "grid", 2)
    draft_grid = _grid(payload.pop("draft_grid", None), "draft_grid", 1)
    path = check_path(payload.get("path"))
    probe = Probe(pair_id=pid, created_at=utcnow(), payload=payload, grid=grid,
                  draft_grid=draft_grid, path=path)
    session.add(probe)
    session.flush()
    return probe.id


def add_tuned_params(session: Session, *, category: str, pair_id: int, family: str,
                     params: Mapping[str, Any], tokens_per_s: float,
                     baseline_tokens_per_s: float | None,
                     provenance: Mapping[str, Any]) -> int:
    """Record a tuning result; the newest per (category, pair) is the one in force."""
    check_category(category)
    row = TunedParams(created_at=utcnow(), category=category,
                      category_key=category_key(category), pair_id=int(pair_id),
                      family=str(family), params=dict(params),
                      tokens_per_s=float(tokens_per_s),
                      baseline_tokens_per_s=None if baseline_tokens_per_s is None
                      else float(baseline_tokens_per_s), provenance=dict(provenance))
    session.add(row)
    session.flush()
    return row.id


def add_categorizer(session: Session, *, name: str, kind: str, payload: bytes,
                    meta: Mapping[str, Any]) -> tuple[int, int]:
    """Store a fitted categoriser as the next version of ``name``; returns (id, version).
    Two fits racing on one name: the unique (name, version) index makes one of them fail
    rather than both claim a version."""
    if not name:
        raise ValueError("a categoriser needs a non-empty name")
    latest = session.scalar(select(Categorizer.version).where(Categorizer.name == name)
                            .order_by(Categorizer.version.desc()).limit(1))
    version = (latest or 0) + 1
    row = Categorizer(created_at=utcnow(), name=name, version=version, kind=kind,
                      payload=_blob("payload", payload), meta=dict(meta))
    session.add(row)
    session.flush()
    return row.id, version
