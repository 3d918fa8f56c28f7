"""Suffix decoding as a proposer: each row proposes the most frequent continuation of its
context's longest suffix, found in its own prompt and output or in the outputs of earlier
requests of its category and tenant (``autospec.suffix``), in host memory.

Its proposals are a function of the context and of what earlier requests emitted, so its q is
one-hot, as prompt lookup's: the rejection rule keeps the target's law exactly. Its blocks
reach the device as prompt lookup's do: one non-blocking copy from a reused staging buffer.
A row's match (the suffix length found) is what the policy sees, as prompt lookup's match.

When a row finishes, its output (after the last ``max_depth`` prompt tokens) joins its
category's memory (``SuffixMemory``; the call's tenant's, ``TenantMemory``, where it names
one), for the requests that come after it. Where the call
records for a store, each row's trace (``autospec.suffix.suffix_trace``: what the proposer
would have drafted at every position it generated) is computed first, every row's before any
row's output joins the memory: the memory the trace reads is the one the call started from,
plus what calls on other threads added while it ran (at batch 1 in one thread, exactly what
the loop saw).
"""

from __future__ import annotations

import time

import torch

from autospec.ngram import agreement
from autospec.suffix import ARCTIC_PACKAGE, SuffixIndex, SuffixSettings, best_of, suffix_trace
from autospec.suffix_memory import SuffixMemory, TenantMemory
from autospec.traces import (
    SUFFIX_TRACE_WIDTH,
    lookup_reader,
    suffix_trace_error,
    trace_length_problem,
)

from . import Block, EngineSetting, HostLookup, LookupReplay

__all__ = ["SuffixLookup"]


class SuffixLookup(HostLookup):
    name = "suffix"
    needs = ("memory",)
    code = 2
    whole_draft = True  # its draft's own length rule: the cost model offers it whole first
    title = "suffix decoding"

    def __init__(self, call):
        super().__init__(call)
        self.memory: SuffixMemory | TenantMemory = call.memory
        self.indices: list[SuffixIndex] | None = None  # built once the prompts are on the host
        self._lookup_s = 0.0
        self._proposals: list[list[int]] = []  # per row, the block it would propose now
        self._matches: list[int] = []
        self._traces: dict[int, bytes | None] | None = None  # row index → its trace (finish)

    def matches(self) -> list[int]:
        """Each row's suffix match now (0: none), and the draft behind it, walked for
        ``k_max`` tokens and kept for ``propose``, which takes its first tokens: a function
        of the context alone, as the rejection rule needs."""
        call = self.call
        if self.indices is None:
            self._build()
        if self.indices is None:  # a device prompt: nothing on the host until the first sync
            self._matches = [0] * len(call.rows)
            self._proposals = [[] for _ in call.rows]
            return self._matches
        self._proposals, self._matches = [], []
        t0 = time.perf_counter()
        for r, idx in zip(call.rows, self.indices):
            toks, m = best_of(idx, self.memory, r.category, r.tokens, call.k_max)
            self._proposals.append(toks)
            self._matches.append(m)  # 0 where it has no draft
        self._lookup_s = time.perf_counter() - t0
        return self._matches

    def sizes(self) -> list[int]:
        """The tokens each row's draft holds now (``matches`` walked them): its own length
        rule, which a block never exceeds."""
        return [len(toks) for toks in self._proposals]

    def propose(self, it, rows: list[int], lengths: list[int]) -> Block:
        """Each served row's draft, cut to its length; the block is as wide as the longest
        of them, not as the policy asked: a draft shorter than k (its own length rule) leaves
        no padding for the target to score."""
        it.spend(self.name, self._lookup_s)
        blocks = {b: self._proposals[b][: lengths[b]] for b in rows}
        return self.staging.block(len(self.call.rows), max(map(len, blocks.values())), blocks)

    def accept(self, it, steps) -> None:
        """Each row's own index learns what it emitted; each row's step gets the match the
        iteration started from and, where the suffix proposer had a draft but did not
        propose, its *shadow* (how many of its leading tokens equal the ones emitted, of how
        many it held): free evidence of where it pays, as prompt lookup's."""
        if self.indices is None:
            self._build()
        matches, proposals = self._matches, self._proposals
        for b, (idx, step) in enumerate(zip(self.indices, steps)):
            new = step.new[: step.emitted]
            match = matches[b] if matches else 0
            step.matches[self.name] = match
            if match and step.proposer != self.name:
                toks = proposals[b]
                step.shadows[self.name] = (agreement(toks, new), min(len(toks), len(new)))
            idx.extend(0, new)

    def _build(self) -> None:
        if self.call.rows[0].tokens is not None:
            self.indices = []
            for r in self.call.rows:
                idx = SuffixIndex(self.memory.settings)
                idx.add(r.tokens[: r.L])
                self.indices.append(idx)

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        if self.indices is not None:
            self.indices = [self.indices[b] for b in keep]
            self._proposals = [self._proposals[b] for b in keep] if self._proposals else []

    def finish(self, row, stats) -> None:
        """The row's output joins its category's memory; where the call records for a store,
        its trace goes to ``stats.traces`` — at the first row's finish every row's trace is
        computed, so that none reads another's output."""
        call = self.call
        if call.record and self._traces is None:
            self._traces = {r.index: None if r.tokens is None else suffix_trace(
                r.tokens[: r.n], r.L, self.memory, r.category, settings=self.memory.settings)
                for r in call.all_rows}
        if self._traces is not None:
            trace = self._traces.pop(row.index, None)
            if trace is not None:
                stats.traces[self.name] = trace
        if row.tokens is not None:
            self.memory.remember(row.category, row.tokens[: row.L], row.tokens[row.L : row.n])

    @classmethod
    def trace_problem(cls, trace: bytes, positions: int) -> str | None:
        """``SUFFIX_TRACE_WIDTH`` bytes per position, each position's pair one its encoding
        holds (``autospec.traces.suffix_trace_error``), or none at all."""
        return trace_length_problem(trace, positions, SUFFIX_TRACE_WIDTH) or (
            suffix_trace_error(trace, positions) if trace else None)

    @classmethod
    def replay(cls, record) -> LookupReplay | None:
        """Its trace (``autospec.suffix.suffix_trace``): per generated position, the match of
        the draft it had there (from the category's memory as the request saw it), how many
        of its tokens equal the output, and how many it held."""
        trace = (getattr(record, "traces", None) or {}).get(cls.name)
        return LookupReplay(lookup_reader(trace)) if trace else None

    @classmethod
    def export(cls, engine: str, plan) -> EngineSetting | None:
        """vLLM's ``suffix`` method (Arctic Inference's suffix tree: k is the most a draft
        may hold, its drafts as long as their match earns, as autospec's; the tree and cache
        bounds autospec's). The other engines have no cross-request suffix cache: None."""
        if engine != "vllm":
            return None
        if plan.k <= 0:
            return EngineSetting()
        d = SuffixSettings()
        return EngineSetting({"method": "suffix", "num_speculative_tokens": plan.k,
                              "suffix_decoding_max_tree_depth": d.max_depth,
                              "suffix_decoding_max_cached_requests": d.max_requests,
                              "suffix_decoding_max_spec_factor": float(d.max_spec_factor),
                              "suffix_decoding_min_token_prob": float(d.min_token_prob)})

    @classmethod
    def describe(cls, settings) -> str:
        d = SuffixSettings()
        return (f"suffix decoding (no draft model), autospec's suffix settings (its defaults, "
                f"Arctic's: tree depth {d.max_depth}, spec factor {d.max_spec_factor:g}, min "
                f"token probability {d.min_token_prob:g}; {d.max_requests} cached requests per "
                f"category); vLLM needs {ARCTIC_PACKAGE} beside it")
