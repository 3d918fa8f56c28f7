"""A proposer written outside autospec, in one file: it drafts from a fixed list of snippets.

Where the context ends with the first j tokens of a snippet (the longest such j, at least
one), it proposes the rest of that snippet. Registered through the public registration
(``autospec.engine.proposers.register``) by the tests that use it; nothing in autospec names it.
"""

from __future__ import annotations

from collections.abc import Sequence

from autospec.engine.proposers import HostLookup, LookupReplay, register, unregister
from autospec.traces import lookup_reader, lookup_trace

__all__ = ["PhraseBook", "registered_phrasebook", "SNIPPETS"]

SNIPPETS: tuple[tuple[int, ...], ...] = ()  # set by ``registered_phrasebook``


def draft_from(snippets: Sequence[Sequence[int]], context: Sequence[int], k: int
               ) -> tuple[list[int], int]:
    """(the rest of the snippet whose longest prefix the context ends with, at most k tokens;
    that prefix's length), ([], 0) where none matches."""
    best, match = [], 0
    for snip in snippets:
        for j in range(min(len(snip) - 1, len(context)), 0, -1):
            if j > match and list(context[-j:]) == list(snip[:j]):
                best, match = list(snip[j:])[:k], j
                break
    return best, match


class PhraseBook(HostLookup):
    name = "phrasebook"
    code = 40
    title = "the phrase book"

    def __init__(self, call):
        super().__init__(call)
        self.snippets = call.options.get(self.name) or SNIPPETS
        self._drafts: list[list[int]] = []
        self._matches: list[int] = []

    def matches(self) -> list[int]:
        self._drafts, self._matches = [], []
        for r in self.call.rows:
            draft, match = ([], 0) if r.tokens is None else draft_from(
                self.snippets, r.tokens[: r.n], self.call.k_max)
            self._drafts.append(draft)
            self._matches.append(match)
        return self._matches

    def sizes(self) -> list[int]:
        return [len(d) for d in self._drafts]

    def propose(self, it, rows, lengths):
        blocks = {b: self._drafts[b][: lengths[b]] for b in rows}
        return self.staging.block(len(self.call.rows), max(map(len, blocks.values())), blocks)

    def accept(self, it, steps) -> None:
        for b, step in enumerate(steps):
            match = self._matches[b] if self._matches else 0
            step.matches[self.name] = match
            if match and step.proposer != self.name:
                draft, new = self._drafts[b], step.new[: step.emitted]
                agree = 0
                while agree < min(len(draft), len(new)) and draft[agree] == new[agree]:
                    agree += 1
                step.shadows[self.name] = (agree, min(len(draft), len(new)))

    def select(self, keep, index) -> None:
        self._drafts = [self._drafts[b] for b in keep] if self._drafts else []

    def finish(self, row, stats) -> None:
        if row.tokens is not None:
            snippets = self.snippets
            stats.traces[self.name] = lookup_trace(
                row.tokens[: row.n], row.L, lambda ctx: draft_from(snippets, ctx, 16))

    @classmethod
    def replay(cls, record):
        trace = (getattr(record, "traces", None) or {}).get(cls.name)
        return LookupReplay(lookup_reader(trace)) if trace else None


class registered_phrasebook:
    """``with registered_phrasebook(snippets):`` — the phrase book registered, drafting from
    ``snippets``, for the block's duration."""

    def __init__(self, snippets: Sequence[Sequence[int]]):
        self.snippets = tuple(tuple(int(t) for t in s) for s in snippets)

    def __enter__(self):
        global SNIPPETS
        SNIPPETS = self.snippets
        register(PhraseBook)
        return PhraseBook

    def __exit__(self, *exc) -> None:
        unregister(PhraseBook.name)
