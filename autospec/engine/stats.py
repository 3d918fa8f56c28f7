"""What one request did: counters in vLLM's convention, per proposer, and its timings.

Torch-free: the live engine and trace replay fill the same ``LoopStats`` through
``autospec.engine.accounting``. Vocabulary, as in ``verify.py``: a block of k proposed tokens
emits accepted + 1 (the recovered or bonus token); mean acceptance length counts that one,
so plain decoding has length 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autospec.traces import PROPOSER_CODES  # who proposed: the store's byte too

__all__ = ["LoopStats", "ProposerCounts", "PROPOSER_CODES", "merge_stats", "bump"]

# the LoopStats fields each proposer's counts live in (the draft model's keep their
# historical unprefixed names: ``drafted`` counts the draft model's proposals only):
# blocks, tokens proposed, accepted, proposed per position, accepted per position
_PREFIX = {"draft": "", "ngram": "ngram_", "suffix": "suffix_"}
_FIELDS = {name: ("drafts" if not p else f"{p}drafts", f"{p}drafted", f"{p}accepted",
                  f"{p}drafted_per_position", f"{p}accepted_per_position")
           for name, p in _PREFIX.items()}


@dataclass(frozen=True)
class ProposerCounts:
    """One proposer's share of a request: ``blocks`` iterations it proposed in, ``proposed``
    tokens it proposed, ``accepted`` of them accepted; per position i (0-based) of its blocks,
    how many blocks reached i and how many accepted it."""

    blocks: int
    proposed: int
    accepted: int
    proposed_per_position: tuple[int, ...]
    accepted_per_position: tuple[int, ...]

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")


@dataclass
class LoopStats:
    """Counters and timings of one request (one row of a batch)."""

    iterations: int = 0
    # the draft model's blocks: iterations, tokens proposed, accepted, per position
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # prompt lookup's (the n-gram proposer's) blocks, counted apart, so that the draft
    # model's acceptance above stays the draft model's
    ngram_drafts: int = 0
    ngram_drafted: int = 0
    ngram_accepted: int = 0
    ngram_accepted_per_position: list[int] = field(default_factory=list)
    ngram_drafted_per_position: list[int] = field(default_factory=list)
    # suffix decoding's blocks (``autospec.suffix``), counted apart the same way
    suffix_drafts: int = 0
    suffix_drafted: int = 0
    suffix_accepted: int = 0
    suffix_accepted_per_position: list[int] = field(default_factory=list)
    suffix_drafted_per_position: list[int] = field(default_factory=list)
    # per iteration: this row's block length, its accepted count, who proposed it
    # (``PROPOSER_CODES``)
    k_schedule: list[int] = field(default_factory=list)
    accepted_schedule: list[int] = field(default_factory=list)
    proposer_schedule: list[int] = field(default_factory=list)
    new_tokens: int = 0
    prompt_tokens: int = 0
    prefill_s: float = 0.0  # first target forward (prompt + first block)
    draft_prefill_s: float = 0.0  # draft forwards that caught up on > 2 tokens (the prompt)
    # each of those catch-ups: (tokens it took in, seconds, its first proposal included)
    draft_catch_ups: list[tuple[int, float]] = field(default_factory=list)
    draft_s: float = 0.0  # the other draft forwards (one token each, or two after a bonus)
    draft_forwards: int = 0
    target_s_by_n: dict[int, list[float]] = field(default_factory=dict)  # batch 1: n → times
    target_forwards: list[tuple[int, float]] = field(default_factory=list)  # (cached, seconds)
    # forwards by (rows in the batch then, tokens scored per row) → seconds, and the draft's
    # seconds per proposed token by rows in the batch (shared by every row of a batch)
    target_s_by_bn: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    draft_s_by_b: dict[int, list[float]] = field(default_factory=dict)
    ngram_s: float = 0.0  # host time of prompt lookup
    suffix_s: float = 0.0  # host time of suffix decoding's lookups, where it proposed
    trace: bytes = b""  # the draft model's acceptance trace (``autospec.traces``)
    trace_kind: str = ""
    confidence: bytes = b""  # the draft's top probability per generated token (store only)
    wall_s: float = 0.0
    started_at: float = 0.0  # time.time() at the start, for matching NVML samples
    stop_reason: str = ""
    path: str = ""  # how forwards ran: "eager", "static", "static+cuda-graphs"
    batch_size: int = 1  # rows of the generate call this request ran in
    peak_kv_bytes: int = 0  # the largest target + draft KV cache the call held
    cache_repacks: int = 0  # times the caches' masked slots were squeezed out
    # prompt + generated tokens (host list; do not modify) and prompt lookup's
    # {"max_n", "min_n"}: what the store's writer computes the n-gram trace from
    tokens: list[int] | None = None
    ngram_settings: dict[str, int] | None = None
    # suffix decoding's trace (``autospec.suffix.suffix_trace``), where the call had the
    # suffix proposer and recorded for a store; None otherwise
    suffix_trace: bytes | None = None
    # the decision records (``autospec.policies.explain``) of the iterations kept, each with
    # its "iteration" (0-based, this call's): every one with ``generate(explain=True)``, the
    # store's sample (``engine.batch.WHY_KEPT``) where only a store asked; None: none kept
    decisions: list[dict] | None = None

    # -- per proposer, and totals ---------------------------------------------------------
    def proposer(self, name: str) -> ProposerCounts:
        """One proposer's counts ("draft": the draft model, "ngram": prompt lookup,
        "suffix": suffix decoding)."""
        blocks, proposed, accepted, proposed_pp, accepted_pp = _FIELDS[name]
        return ProposerCounts(
            blocks=getattr(self, blocks), proposed=getattr(self, proposed),
            accepted=getattr(self, accepted),
            proposed_per_position=tuple(getattr(self, proposed_pp)),
            accepted_per_position=tuple(getattr(self, accepted_pp)))

    @property
    def by_proposer(self) -> dict[str, ProposerCounts]:
        """Every proposer's counts, by name."""
        return {name: self.proposer(name) for name in _PREFIX}

    @property
    def proposed(self) -> int:
        """Tokens proposed by every proposer together."""
        return sum(c.proposed for c in self.by_proposer.values())

    @property
    def proposed_accepted(self) -> int:
        """Proposed tokens accepted, every proposer together."""
        return sum(c.accepted for c in self.by_proposer.values())

    def count_block(self, proposer: str, k: int, m: int) -> None:
        """A block of k proposed by ``proposer`` with m accepted."""
        if proposer == "draft":  # the usual case, without the name lookups
            self.drafts += 1
            self.drafted += k
            self.accepted += m
            bump(self.drafted_per_position, k)
            bump(self.accepted_per_position, m)
            return
        blocks, proposed, accepted, proposed_pp, accepted_pp = _FIELDS[proposer]
        setattr(self, blocks, getattr(self, blocks) + 1)
        setattr(self, proposed, getattr(self, proposed) + k)
        setattr(self, accepted, getattr(self, accepted) + m)
        bump(getattr(self, proposed_pp), k)
        bump(getattr(self, accepted_pp), m)

    # -- derived ----------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        """The draft model's acceptance (``proposer(name).acceptance`` for another's)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

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
        for name in ("new_tokens", "prompt_tokens", "draft_forwards", "ngram_s", "suffix_s"):
            setattr(out, name, getattr(out, name) + getattr(st, name))
        for blocks, proposed, accepted, proposed_pp, accepted_pp in _FIELDS.values():
            for name in (blocks, proposed, accepted):
                setattr(out, name, getattr(out, name) + getattr(st, name))
            for name in (proposed_pp, accepted_pp):
                acc = getattr(out, name)
                for i, v in enumerate(getattr(st, name)):
                    if i < len(acc):
                        acc[i] += v
                    else:
                        acc.append(v)
    longest = max(rows, key=lambda st: st.iterations)
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
