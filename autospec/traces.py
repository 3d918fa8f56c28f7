"""Acceptance traces: their encodings and the per-request trace being filled. Torch-free:
the engine writes traces, the store keeps them, replay reads them, and none of the three
imports another for it.

An acceptance trace holds one byte per generated position telling whether the draft model,
continuing from the target's own prefix, would have produced that position's token — greedy:
1/0 for its argmax matching; sampling: round(254 · β) with β = Σ min(p, q), the probability
of acceptance; 255 where nobody observed it (decoded with k = 0, or the final bonus token).
For greedy decoding the trace does not depend on k, so replaying it under another k gives
the accepted lengths that k would have seen, exactly.
"""

from __future__ import annotations

__all__ = ["PROPOSER_CODES", "TRACE_GREEDY", "TRACE_SAMPLED", "UNOBSERVED", "TRACE_CATCH_UP_MAX", "NGRAM_NONE",
           "NGRAM_TRACE_K", "MATCH_REACH", "encode_trace_value", "decode_trace_value", "Trace"]

# who proposed an iteration's block, as ``LoopStats.proposer_schedule`` and the store's
# ``proposer_schedule`` byte name it: 0 the draft model (or nobody, at k = 0), 1 prompt lookup,
# 2 suffix decoding
PROPOSER_CODES = {"draft": 0, "ngram": 1, "suffix": 2}

# Acceptance traces: one byte per generated position, telling whether the draft, continuing
# from the target's own prefix, would have produced that position's token.
TRACE_GREEDY = "greedy"  # 1 the draft's argmax matched, 0 it did not, 255 not observed
TRACE_SAMPLED = "sampled"  # round(254 · β) with β = Σ_x min(p(x), q(x)), 255 not observed
UNOBSERVED = 255
# positions one draft catch-up forward may fill in (the loop, and the simulator mirroring it)
TRACE_CATCH_UP_MAX = 64
# Confidence, beside the trace: round(254 · max_x q(x)), the draft's top probability at each
# generated position where it ran on the target's own prefix (255 elsewhere). Draft-side early
# stopping decides on exactly this number, so replay can apply any threshold to it.
# N-gram traces (``autospec.ngram.ngram_trace``): one byte per generated position, the length
# n of the prompt-lookup match there (how many trailing tokens of the context agree with the
# tokens before the proposal's source, ``NgramIndex.match``) and how many leading tokens of its
# proposal match the output (0 … 16), as (min(n, 14) − 1) · 17 + matching
# (``encode_trace_value`` below), or:
NGRAM_NONE = 255  # the index had no match there: no proposal
NGRAM_TRACE_K = 16  # the longest block an n-gram trace value covers
MATCH_REACH = 14  # (n - 1) * 17 + 16 <= 254: the longest match length measured and recorded


def encode_trace_value(matched: int, agree: int) -> int:
    """One position of the n-gram trace: the match length the proposer had there (1…14,
    longer ones recorded as 14) and how many of its first 16 proposed tokens equal the output
    from there on (0…16); NGRAM_NONE without a match."""
    if matched <= 0:
        return NGRAM_NONE
    return (min(matched, MATCH_REACH) - 1) * (NGRAM_TRACE_K + 1) + min(agree, NGRAM_TRACE_K)


def decode_trace_value(value: int) -> tuple[int, int] | None:
    """(match length, agreeing tokens) of one n-gram trace byte; None for NGRAM_NONE."""
    if value == NGRAM_NONE:
        return None
    n, agree = divmod(int(value), NGRAM_TRACE_K + 1)
    return n + 1, agree



class Trace:
    """The acceptance trace of one request, filled as positions get observed, and beside it
    the draft's confidence at the same positions (``store.records``)."""

    def __init__(self, greedy: bool, max_len: int):
        self.greedy = greedy
        self.values = bytearray([UNOBSERVED]) * max_len
        self.confidence = bytearray([UNOBSERVED]) * max_len

    def put(self, position: int, values, confidence=()) -> None:
        """Set generated positions position, position+1, … (those past the end are dropped);
        ``confidence``: quantized top probabilities for the same positions."""
        for arr, vals in ((self.values, values), (self.confidence, confidence)):
            for i, v in enumerate(vals):
                if 0 <= position + i < len(arr):
                    arr[position + i] = int(v)

    def finish(self, new_tokens: int) -> bytes:
        return bytes(self.values[:new_tokens])

    def finish_confidence(self, new_tokens: int) -> bytes:
        return bytes(self.confidence[:new_tokens])
