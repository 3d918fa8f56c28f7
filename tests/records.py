"""Building a request's proposer rows in tests: the draft model's, a lookup's."""

from __future__ import annotations

from collections.abc import Sequence

from autospec.store.record import ProposerRecord


def blocks(ks: Sequence[int], acc: Sequence[int]) -> dict:
    """The counters of blocks of ``ks`` tokens with ``acc`` accepted (a ``ProposerRecord``'s
    keyword arguments): blocks, tokens proposed and accepted, and by position."""
    ks, acc = [k for k in ks if k], [a for k, a in zip(ks, acc) if k]
    width = max(ks, default=0)
    return dict(blocks=len(ks), proposed=sum(ks), accepted=sum(acc),
                proposed_per_position=[sum(k > i for k in ks) for i in range(width)],
                accepted_per_position=[sum(a > i for a in acc) for i in range(width)])


def draft(*, trace: bytes | None = None, confidence: bytes | None = None, **counters
          ) -> dict[str, ProposerRecord]:
    """``proposers=`` of a request that had the draft model (``counters``: ``blocks(...)``'s
    or ``ProposerRecord``'s own keywords)."""
    return {"draft": ProposerRecord(kind="model", trace=trace, confidence=confidence,
                                    **counters)}


def lookup(name: str, *, trace: bytes | None = None, settings: dict | None = None, **counters
           ) -> dict[str, ProposerRecord]:
    """``proposers=`` entry of a lookup proposer (``ngram``, ``suffix``, …)."""
    return {name: ProposerRecord(kind="lookup", trace=trace, settings=settings, **counters)}


def trace_row(trace_kind: str, trace: bytes | None, *, lookups: dict[str, bytes] | None = None,
              **fields):
    """A ``TraceRow`` (what replay reads) of a request that had the draft model with
    acceptance ``trace`` (None: no draft model) and the lookup proposers ``lookups`` (name →
    trace); ``fields``: the row's others (category, batch_size, prompt_tokens, …)."""
    from autospec.store.queries import TraceRow

    traces = {} if trace is None else {"draft": bytes(trace)}
    kinds = {} if trace is None else {"draft": "model"}
    for name, t in (lookups or {}).items():
        traces[name], kinds[name] = bytes(t), "lookup"
    fields.setdefault("k_schedule", b"")
    fields.setdefault("accepted_schedule", b"")
    return TraceRow(trace_kind, traces, kinds=kinds, **fields)
