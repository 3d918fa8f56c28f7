"""What one request did: counters in vLLM's convention, per proposer, and its timings.

Torch-free: the live engine and trace replay fill the same ``LoopStats`` through
``autospec.engine.accounting``, each proposer's counts under its name. Vocabulary, as in ``verify.py``: a block of k proposed tokens
emits accepted + 1 (the recovered or bonus token); mean acceptance length counts that one,
so plain decoding has length 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LoopStats", "ProposerCounts", "merge_stats", "bump"]


@dataclass
class ProposerCounts:
    """One proposer's share of a request: ``blocks`` iterations it proposed in, ``proposed``
    tokens it proposed, ``accepted`` of them accepted; per position i (0-based) of its blocks,
    how many blocks reached i and how many accepted it; ``seconds`` it spent proposing on the
    host (a lookup's; a model's forwards are the request's ``draft_s``)."""

    blocks: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, k: int, m: int) -> None:
        """A block of k proposed with m accepted."""
        self.blocks += 1
        self.proposed += k
        self.accepted += m
        bump(self.proposed_per_position, k)
        bump(self.accepted_per_position, m)

    def merge(self, other: ProposerCounts) -> None:
        for name in ("blocks", "proposed", "accepted", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("proposed_per_position", "accepted_per_position"):
            mine = getattr(self, name)
            for i, v in enumerate(getattr(other, name)):
                if i < len(mine):
                    mine[i] += v
                else:
                    mine.append(v)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per block, the bonus or recovered one included (1 without blocks)."""
        return 1.0 + self.accepted / self.blocks if self.blocks else 1.0


@dataclass
class LoopStats:
    """Counters and timings of one request (one row of a batch)."""

    iterations: int = 0
    # per proposer the call had, by name (``autospec.engine.proposers``): its blocks
    counts: dict[str, ProposerCounts] = field(default_factory=dict)
    # the call's model proposer (None: none): the one whose forwards ``draft_s`` times
    model: str | None = None
    # every proposer the call opened, by name, the model first (those that never proposed
    # too: ``by_proposer`` lists them with zeros)
    proposers: tuple[str, ...] = ()
    # per iteration: this row's block length, its accepted count, who proposed it (a
    # proposer's name; None: nobody, a plain step)
    k_schedule: list[int] = field(default_factory=list)
    accepted_schedule: list[int] = field(default_factory=list)
    proposer_schedule: list[str | None] = field(default_factory=list)
    new_tokens: int = 0
    prompt_tokens: int = 0
    max_new_tokens: int = 0  # the tokens it could generate (its limit; 0: not known)
    prefill_s: float = 0.0  # first target forward (prompt + first block)
    draft_prefill_s: float = 0.0  # model forwards that caught up on > 2 tokens (the prompt)
    # each of those catch-ups: (tokens it took in, seconds, its first proposal included)
    draft_catch_ups: list[tuple[int, float]] = field(default_factory=list)
    draft_s: float = 0.0  # the model's other forwards (one token each, or two after a bonus)
    draft_forwards: int = 0
    target_s_by_n: dict[int, list[float]] = field(default_factory=dict)  # batch 1: n → times
    target_forwards: list[tuple[int, float]] = field(default_factory=list)  # (cached, seconds)
    # forwards by (rows in the batch then, tokens scored per row) → seconds, and the model's
    # seconds per proposed token by rows in the batch (shared by every row of a batch)
    target_s_by_bn: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    draft_s_by_b: dict[int, list[float]] = field(default_factory=dict)
    # per proposer, its trace (what its replay rule reads: ``Proposer.replay``): bytes, or a
    # callable returning them that the store's writer runs off the hot path
    traces: dict[str, object] = field(default_factory=dict)
    trace_kind: str = ""
    # per proposer, what else it records for the store (settings, confidences): JSON-ready
    # values, bytes where ``extras`` says so
    extras: dict[str, dict] = field(default_factory=dict)
    wall_s: float = 0.0
    started_at: float = 0.0  # time.time() at the start, for matching NVML samples
    stop_reason: str = ""
    path: str = ""  # how forwards ran: "eager", "static", "static+cuda-graphs"
    batch_size: int = 1  # rows of the generate call this request ran in
    batch_id: str | None = None  # shared by the rows of one batched call (None: batch 1)
    peak_kv_bytes: int = 0  # the largest target + draft KV cache the call held
    cache_repacks: int = 0  # times the caches' masked slots were squeezed out
    # the decision records (``autospec.policies.explain``) of the iterations kept, each with
    # its "iteration" (0-based, this call's): every one with ``generate(explain=True)``, the
    # store's sample (``engine.batch.WHY_KEPT``) where only a store asked; None: none kept
    decisions: list[dict] | None = None

    # -- per proposer, and totals ---------------------------------------------------------
    def proposer(self, name: str | None) -> ProposerCounts:
        """One proposer's counts (zeros where it proposed nothing)."""
        return self.counts.get(name) or ProposerCounts()

    @property
    def by_proposer(self) -> dict[str, ProposerCounts]:
        """Every proposer's counts the call had, by name (zeros where one never proposed)."""
        return {name: self.proposer(name) for name in dict.fromkeys(
            (*self.proposers, *self.counts))}

    @property
    def proposed(self) -> int:
        """Tokens proposed by every proposer together."""
        return sum(c.proposed for c in self.counts.values())

    @property
    def proposed_accepted(self) -> int:
        """Proposed tokens accepted, every proposer together."""
        return sum(c.accepted for c in self.counts.values())

    def count_block(self, proposer: str, k: int, m: int) -> None:
        """A block of k proposed by ``proposer`` with m accepted."""
        counts = self.counts.get(proposer)
        if counts is None:
            counts = self.counts[proposer] = ProposerCounts()
        counts.add(k, m)

    # -- the model proposer's (the draft model's): the headline figures ----------------------
    @property
    def drafts(self) -> int:
        return self.proposer(self.model).blocks

    @property
    def drafted(self) -> int:
        return self.proposer(self.model).proposed

    @property
    def accepted(self) -> int:
        return self.proposer(self.model).accepted

    @property
    def accepted_per_position(self) -> list[int]:
        return self.proposer(self.model).accepted_per_position

    @property
    def drafted_per_position(self) -> list[int]:
        return self.proposer(self.model).proposed_per_position

    @property
    def acceptance(self) -> float:
        """The model proposer's acceptance (``proposer(name).acceptance`` for another's)."""
        return self.proposer(self.model).acceptance

    @property
    def mean_accepted_length(self) -> float:
        return self.proposer(self.model).mean_accepted_length

    @property
    def confidence(self) -> bytes:
        """The model proposer's top probability per generated position, where the call
        recorded it for a store (empty: not recorded)."""
        got = (self.extras.get(self.model) or {}).get("confidence") if self.model else None
        return got if isinstance(got, bytes) else b""

    @property
    def trace(self) -> bytes:
        """The model proposer's acceptance trace (``autospec.traces``; empty: none)."""
        got = self.traces.get(self.model) if self.model else None
        return got if isinstance(got, bytes) else b""

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def target_time(self, n: int) -> float:
        """Median time of a target forward scoring n tokens (after the prefill)."""
        times = sorted(self.target_s_by_n.get(n, []))
        return times[len(times) // 2] if times else float("nan")

    @property
    def draft_time(self) -> float:
        return self.draft_s / self.draft_forwards if self.draft_forwards else float("nan")


def bump(counts: list[int], upto: int) -> None:
    """counts[i] += 1 for i < upto, growing the list as needed."""
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


def merge_stats(rows: list[LoopStats]) -> LoopStats:
    """One batch's counters: sums over its rows; the schedule, timings and wall time of the
    batch (every row shares its forwards)."""
    out = LoopStats()
    for st in rows:
        for name in ("new_tokens", "prompt_tokens", "draft_forwards"):
            setattr(out, name, getattr(out, name) + getattr(st, name))
        for name, counts in st.counts.items():
            out.counts.setdefault(name, ProposerCounts()).merge(counts)
    longest = max(rows, key=lambda st: st.iterations)
    out.model, out.batch_id, out.proposers = longest.model, longest.batch_id, longest.proposers
    out.iterations, out.k_schedule = longest.iterations, list(longest.k_schedule)
    out.target_s_by_bn = dict(longest.target_s_by_bn)
    out.draft_s_by_b = dict(longest.draft_s_by_b)
    out.draft_s = longest.draft_s
    out.prefill_s = longest.prefill_s
    out.wall_s = max(st.wall_s for st in rows)
    out.started_at = min(st.started_at for st in rows)
    out.batch_size = len(rows)
    out.peak_kv_bytes = max(st.peak_kv_bytes for st in rows)
    out.cache_repacks = longest.cache_repacks
    out.trace_kind, out.path = longest.trace_kind, longest.path
    out.stop_reason = ",".join(sorted({st.stop_reason for st in rows}))
    out.decisions = longest.decisions  # one record per iteration of the batch
    return out
