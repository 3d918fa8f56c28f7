"""Prompt lookup (the n-gram proposer) as a proposer: each row copies what followed the latest
earlier occurrence of its context's last tokens (``autospec.ngram.NgramIndex``), in host
memory, a few dictionary probes per row.

Its proposals are a function of the context, so its q is one-hot: a proposal x is accepted
with probability p(x), and on rejection the next token is drawn from p without x — the
target's law exactly. Its blocks are host data: they reach the device in one non-blocking
copy per iteration it proposes in, from a staging buffer reused by every iteration (pinned
on a GPU; the iteration's sync has completed the previous copy before the buffer is
rewritten), never by a blocking copy of a Python list.

Where a row had a match but another proposer (or nobody) drafted, the block it would have
proposed is compared with what was emitted: its *shadow*, free evidence of where it pays.
"""

from __future__ import annotations

import time

import torch

from autospec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramIndex, agreement

from . import Block, HostLookup

__all__ = ["PromptLookup"]


class PromptLookup(HostLookup):
    name = "ngram"

    def __init__(self, batch):
        super().__init__(batch)
        self.factory = batch.ngram_factory or NgramIndex
        self.indices = self.by_row = None  # built once the prompts are on the host
        self._matches: list[int] = []

    def matches(self) -> list[int]:
        """Each row's match length now (0: none, or no index yet)."""
        if self.indices is None:
            self._build()
        self._matches = ([idx.match()[0] for idx in self.indices] if self.indices is not None
                         else [0] * len(self.batch.rows))
        return self._matches

    def propose(self, it, rows: list[int], lengths: list[int]) -> Block:
        t0 = time.perf_counter()
        blocks = {b: self.indices[b].propose(lengths[b])[0] for b in rows}
        it.lookup_s += time.perf_counter() - t0
        return self.staging.block(len(self.indices), max(lengths[b] for b in rows), blocks)

    def accept(self, it, steps) -> None:
        """Each row's index learns what was emitted; rows it did not draft get its shadow."""
        if self.indices is None:
            self._build()  # a device prompt: the index starts once the first sync brought it
        for b, (idx, step) in enumerate(zip(self.indices, steps)):
            if step.proposer != self.name and self._matches and self._matches[b]:
                step.shadow = agreement(idx.propose(len(step.new))[0],
                                        step.new[: step.emitted])
            idx.extend(step.new[: step.emitted])

    def _build(self) -> None:
        if self.indices is None and self.batch.rows[0].tokens is not None:
            self.indices = [self.factory(list(r.tokens[: r.L])) for r in self.batch.rows]
            self.by_row = {r.index: idx for r, idx in zip(self.batch.rows, self.indices)}

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        if self.indices is not None:
            self.indices = [self.indices[b] for b in keep]

    def finish(self, row, stats) -> None:
        """What the store's writer computes the row's n-gram trace from (a custom index
        without the host list leaves it None: no trace rather than a guess)."""
        idx = self.by_row[row.index] if self.by_row is not None else None
        tokens = getattr(idx, "tokens", None)
        stats.tokens = (tokens[: row.n] if isinstance(tokens, list) and len(tokens) >= row.n
                        else None)  # a row cut back to its batch's end (emit.settle)
        stats.ngram_settings = {"max_n": int(getattr(idx, "max_n", DEFAULT_MAX_N)),
                                "min_n": int(getattr(idx, "min_n", DEFAULT_MIN_N))}
