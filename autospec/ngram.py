"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the most recent earlier
occurrence of the context's last n tokens, n from ``max_n`` down to ``min_n`` (vLLM's
``prompt_lookup_max``/``prompt_lookup_min``; transformers' ``prompt_lookup_num_tokens``),
searching the prompt and everything generated so far.

The proposal is a deterministic function of the context, so in the rejection rule its q is
one-hot at the proposed token: a proposal x is accepted with probability p(x) and, on
rejection, the next token is drawn from p with x removed (``verify.rejection_sample`` with a
one-hot q does exactly this). Greedy verification is the same rule with one-hot p. The output
is the target's, whatever is proposed.

Cost. A scan over the whole context per proposal grows with the context; the index here is a
hash map per n from each n-gram to the positions after its latest few occurrences, updated by
``extend`` in O(max_n − min_n + 1) per new token, so a lookup is O(max_n) dictionary probes
and a bounded comparison (``NgramIndex.match``) at any context length.
``scripts/ngram_cost.py`` measures it against a target forward.

The store keeps, per request, ``ngram_trace``: what the proposer would have matched at every
generated position (see that function), so replay can price the n-gram proposer on traffic
the draft model served, and the other way round.
"""

from __future__ import annotations

from collections.abc import Sequence

from autospec.traces import (  # the one definition (torch-free)
    MATCH_REACH,
    NGRAM_NONE,
    NGRAM_TRACE_K,
    decode_trace_value,
    encode_trace_value,
)

__all__ = ["NgramIndex", "DEFAULT_MAX_N", "DEFAULT_MIN_N", "MATCH_REACH", "OCCURRENCES",
           "NGRAM_NONE", "NGRAM_TRACE_K", "ngram_trace", "agreement", "encode_trace_value",
           "decode_trace_value"]

DEFAULT_MAX_N = 3  # longest suffix matched (transformers' default is 2, vLLM asks for it)
DEFAULT_MIN_N = 1  # shortest
OCCURRENCES = 8  # earlier occurrences of an n-gram the index keeps, to choose the source among


class NgramIndex:
    """The token history of one request and, per n in [min_n, max_n], the latest
    ``OCCURRENCES`` positions at which each n-gram *ended before the current last token* — so
    that looking up the current suffix finds its earlier occurrences, never itself."""

    def __init__(self, tokens: Sequence[int] = (), *, max_n: int = DEFAULT_MAX_N,
                 min_n: int = DEFAULT_MIN_N):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got "
                             f"min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = int(max_n), int(min_n)
        self.tokens: list[int] = []
        # n → {n-gram: [end, …]} (oldest first, the latest OCCURRENCES): tokens[end - n : end]
        # is the n-gram, tokens[end] what followed it
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(self.min_n, self.max_n + 1)}
        self._matched: tuple[int, int] | None = None  # match() of the current history
        tokens = list(tokens)
        self._base = len(tokens)  # tokens given at construction (the prompt): no cursor there
        self._cursor: int | None = None  # where the latest copy left off in its source
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens. Each n-gram that ends before the new last token becomes findable.
        Past the construction's tokens, a token the current match's source predicted moves
        the copy cursor to just after it in the source (see ``match``)."""
        toks = self.tokens
        for t in new:
            t = int(t)
            if len(toks) >= self._base:
                length, src = self.match()
                if length and toks[src] == t:
                    self._cursor = src + 1
            self._matched = None
            end = len(toks)  # the n-grams ending here are followed by t: index them
            for n, ends in self._ends.items():
                if end >= n:
                    seen = ends.setdefault(tuple(toks[end - n : end]), [])
                    seen.append(end)
                    if len(seen) > OCCURRENCES:
                        del seen[0]
            toks.append(t)

    def truncate(self, length: int) -> None:
        """Drop tokens past ``length`` (rebuilds the index; the loop never needs it, since
        tokens it emits are final, but a caller reusing an index may)."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self._matched, self._cursor = [], None, None
            self._base = min(self._base, length)
            for ends in self._ends.values():
                ends.clear()
            self.extend(kept)

    def match(self) -> tuple[int, int]:
        """(length, position after the match) of the proposal's source: among the latest
        ``OCCURRENCES`` earlier occurrences of the longest suffix n-gram that occurred (n from
        max_n down to min_n), the one whose preceding tokens agree with the context's the
        furthest back; among those, the first at or after the copy cursor, else the latest;
        (0, -1) when none occurred.

        The length is how far they agree, counted back from their ends: at least n, extended
        past max_n up to ``MATCH_REACH`` tokens. It tells a copy in progress from a chance hit,
        which n alone (≤ max_n) cannot: after a long match the proposal is accepted far more
        often, and evenly along the block, than after a 1-token one (measurements:
        docs/benchmarks.md). The statistics and the cost model condition on it (``LiveStats``
        by match length), so a copy run gets long blocks and a chance hit short ones. The
        occurrence is chosen by it, not by recency: a line like ``return x`` occurs often, the
        line being copied once. At most OCCURRENCES × MATCH_REACH comparisons, once per
        history: the loop asks for the match, then proposes from it.

        The copy cursor is the source position just after the latest generated token that
        the match before it predicted (a function of the history alone, so the stored trace
        and the live proposer agree). Copies walk forward through their source: a summary
        quotes a passage in its order, an edit walks down the function. So at a tie, most
        often a chance hit of 1–3 tokens at a quotation's start, the occurrence next after
        where the last copy left off is the likelier source; the latest is often the
        model's own earlier output."""
        if self._matched is None:
            self._matched = self._match()
        return self._matched

    def _match(self) -> tuple[int, int]:
        toks = self.tokens
        size = len(toks)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            ends = self._ends[n].get(tuple(toks[size - n :]))
            if ends:
                cursor = self._cursor
                best, best_end = (-1, ()), -1
                for end in reversed(ends):  # latest first
                    length = n
                    while (length < MATCH_REACH and end - 1 - length >= 0
                           and toks[end - 1 - length] == toks[size - 1 - length]):
                        length += 1
                    # ties: the first at or after the cursor, else the latest
                    key = (length, (1, -end) if cursor is not None and end >= cursor
                           else (0, end))
                    if key > best:
                        best, best_end = key, end
                return best[0], best_end
        return 0, -1

    def propose(self, k: int) -> tuple[list[int], int]:
        """(up to k proposed tokens, the match length as ``match`` gives it): the tokens that
        followed the match, as many as the history holds after it (fewer than k near the
        end); ([], 0) without a match. The continuation may run into the current suffix
        itself (a repeating pattern keeps proposing its period)."""
        if k <= 0:
            return [], 0
        n, end = self.match()
        if n == 0:
            return [], 0
        toks = self.tokens
        out = toks[end : end + k]
        # a match ending right before the suffix repeats with period len(toks) - end: extend
        # the proposal along that period instead of stopping at the history's end
        period = len(toks) - end  # ≥ 1: the match ended before the last token
        while len(out) < k:
            out.append(out[len(out) - period])
        return out, n


def agreement(proposal: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens of ``proposal`` equal ``tokens`` (as far as both go)."""
    same, stop = 0, min(len(proposal), len(tokens))
    while same < stop and proposal[same] == tokens[same]:
        same += 1
    return same


# -- the n-gram trace's bytes (store.records ``ngram_trace``) ------------------------------
def ngram_trace(tokens: Sequence[int], prompt_len: int, *, max_n: int, min_n: int,
                k: int = NGRAM_TRACE_K) -> bytes:
    """The n-gram proposer's trace of one request: one byte per generated position t
    (``prompt_len`` ≤ t < len(tokens)), how many leading tokens of the proposal made from
    ``tokens[:t]`` (``NgramIndex(max_n=, min_n=).propose(k)``) equal ``tokens[t : t + k]``
    (0 … k; compared only as far as tokens exist) together with the length n of the match
    the proposal came from (``encode_trace_value``: (min(n, 14) − 1) · 17 + agreeing), or
    ``NGRAM_NONE`` (255) where the index had no match there (no proposal). The match length
    lets replay apply the hybrid proposer's minimum match.

    Under greedy verification an n-gram block of k' ≤ k tokens started at t accepts exactly
    min(value, k') tokens (the output is the target's argmax chain, whatever was proposed, and
    a shorter proposal is a prefix of a longer one), so replay can price the n-gram proposer at
    every position, drafted or not. For sampled traffic it is the match against the tokens that
    were sampled, one draw of what the rule would have kept, not an acceptance probability.

    One index, extended one token at a time: O(len(tokens) × (max_n + k)) host work. It runs
    on the store's writer thread (``RequestRecord.finish``), never on the request's."""
    if not 0 < k <= NGRAM_TRACE_K:
        raise ValueError(f"k must be in 1 … {NGRAM_TRACE_K}, got {k}")
    toks = [int(t) for t in tokens]
    size = len(toks)
    prompt_len = max(0, min(int(prompt_len), size))
    index = NgramIndex(toks[:prompt_len], max_n=max_n, min_n=min_n)
    out = bytearray(size - prompt_len)
    for t in range(prompt_len, size):
        proposal, matched = index.propose(k)
        if not matched:
            out[t - prompt_len] = NGRAM_NONE
        else:
            out[t - prompt_len] = encode_trace_value(
                matched, agreement(proposal, toks[t : t + len(proposal)]))
        index.extend((toks[t],))
    return bytes(out)
