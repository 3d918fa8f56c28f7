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

from collections.abc import Sequence

__all__ = ["K_LIMIT", "MATCH_BUCKETS", "BATCH_BUCKET_TOP", "batch_bucket", "NO_DRAFT", "CONFIDENCE_SCALE",
           "CONFIDENCE_BINS", "TRACE_GREEDY", "TRACE_SAMPLED", "UNOBSERVED", "TRACE_CATCH_UP_MAX",
           "NGRAM_NONE", "NGRAM_TRACE_K", "MATCH_REACH", "SUFFIX_TRACE_WIDTH",
           "encode_trace_value", "decode_trace_value", "decode_suffix_value", "evidence",
           "suffix_trace_error", "trace_length_problem", "Trace", "lookup_trace",
           "lookup_reader"]

# the largest lookahead k anything accepts (the API, the store's per-position counters)
K_LIMIT = 64
# n-gram and suffix statistics are kept per match length in these buckets, each the shortest
# length it holds (``policies.live.match_bucket``): a long match's proposal is accepted far more
# often than a chance hit's, so a copy run and a chance hit get their own curves, with evidence
# enough in each (up to ``MATCH_REACH``)
MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 14)
# batch-size buckets policies keep statistics by: powers of two up to this one (32+)
BATCH_BUCKET_TOP = 32
# a pair's draft name in the store where there is no draft model (lookups only)
NO_DRAFT = "none (n-gram)"
# the draft's confidence at its last token, as stored: round(CONFIDENCE_SCALE · p)
CONFIDENCE_SCALE = 254
# the bins acceptance by confidence is counted in: [0, 0.1), [0.1, 0.2), … [0.9, 1.0]
CONFIDENCE_BINS = 10

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


# Suffix traces (``autospec.suffix.suffix_trace``): SUFFIX_TRACE_WIDTH bytes per generated
# position — the n-gram trace's byte for suffix decoding's draft there (``encode_trace_value``:
# the length of the context's suffix it matched, recorded up to MATCH_REACH, and how many of
# the draft's leading tokens equal the output from there on; NGRAM_NONE: no draft), then how
# many tokens the draft holds (0 … NGRAM_TRACE_K). Unlike prompt lookup's, a suffix draft has
# its own length (``max_spec_factor`` × the match, while its path's probability holds): a
# block never holds more, and the cost model prices it by that length, so replay needs it.
SUFFIX_TRACE_WIDTH = 2


def capped(stop_reason: str | None) -> bool:
    """Whether a request's stop reason (``LoopStats.stop_reason``, stored as is) says it might
    have run on: anything but an EOS or a stopping criterion (its cap, a context limit …)."""
    return stop_reason not in ("eos", "stopping_criteria")


def batch_bucket(batch_size: int) -> int:
    """The batch-size bucket policies keep statistics by: 1, 2–3, 4–7, 8–15, 16–31, 32+,
    named by its smallest batch size."""
    b = max(1, int(batch_size))
    return min(BATCH_BUCKET_TOP, 1 << (b.bit_length() - 1))


def evidence(value: int, greedy: bool) -> float:
    """An observed acceptance-trace byte as acceptance evidence: greedy 1/0 as it is, sampled
    the β it rounds (value / 254)."""
    return value if greedy else value / 254


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



def decode_suffix_value(trace: bytes | Sequence[int], position: int
                        ) -> tuple[int, int, int] | None:
    """(match length, agreeing tokens, draft length) of a suffix trace at generated position
    ``position``; None where suffix decoding had no draft."""
    i = SUFFIX_TRACE_WIDTH * position
    got = decode_trace_value(trace[i])
    return None if got is None else (got[0], got[1], int(trace[i + 1]))


def lookup_trace(tokens: Sequence[int], prompt_len: int, draft_at, *,
                 k: int = NGRAM_TRACE_K) -> bytes:
    """A lookup proposer's trace of one request, in suffix decoding's encoding
    (SUFFIX_TRACE_WIDTH bytes per generated position t, ``prompt_len`` ≤ t < len(tokens)):
    ``draft_at(tokens[:t])`` → (its draft there, at most ``k`` tokens; its match length, 0:
    none), recorded as (``encode_trace_value`` of the match and of how many of the draft's
    leading tokens equal ``tokens[t : t + k]``, the draft's length), or (NGRAM_NONE, 0)
    without a draft. What a lookup proposer's replay reads (``lookup_reader``)."""
    toks = [int(t) for t in tokens]
    prompt_len = max(0, min(int(prompt_len), len(toks)))
    out = bytearray(SUFFIX_TRACE_WIDTH * (len(toks) - prompt_len))
    for i, t in enumerate(range(prompt_len, len(toks))):
        draft, matched = draft_at(toks[:t])
        draft = list(draft)[:k]
        at = SUFFIX_TRACE_WIDTH * i
        if matched and draft:
            agree = 0
            while agree < len(draft) and t + agree < len(toks) and draft[agree] == toks[t + agree]:
                agree += 1
            out[at], out[at + 1] = encode_trace_value(matched, agree), len(draft)
        else:
            out[at] = NGRAM_NONE
    return bytes(out)


def lookup_reader(trace: bytes):
    """``read(g)`` over a trace in suffix decoding's encoding: (match length, agreeing
    tokens, draft length) at generated position g, None without a draft (or past its end)."""
    positions = len(trace) // SUFFIX_TRACE_WIDTH

    def read(g: int):
        return decode_suffix_value(trace, g) if 0 <= g < positions else None

    return read


def trace_length_problem(trace: bytes | Sequence[int], positions: int,
                         width: int | None = None) -> str | None:
    """What is wrong with the length of a proposer's trace of a request that generated
    ``positions`` tokens (None: nothing): ``width`` bytes per position (None: any whole
    number of bytes per position), or none at all (empty: nothing recorded)."""
    n = len(trace)
    if n == 0 or (n == width * positions if width is not None
                  else positions and n % positions == 0):
        return None
    per = "a whole number" if width is None else str(width)
    return f"{n} bytes for {positions} generated positions: {per} per position"


def suffix_trace_error(trace: bytes | Sequence[int], positions: int) -> str | None:
    """What is wrong with a suffix trace for ``positions`` generated positions (None: it is
    well formed): its length, or the first position whose bytes no trace holds (a match
    value past MATCH_REACH's, a draft longer than NGRAM_TRACE_K or than its agreement allows,
    a length without a draft)."""
    if len(trace) != SUFFIX_TRACE_WIDTH * positions:
        return (f"{len(trace)} bytes for {positions} generated positions: "
                f"{SUFFIX_TRACE_WIDTH} per position")
    top = (MATCH_REACH - 1) * (NGRAM_TRACE_K + 1) + NGRAM_TRACE_K
    for p in range(positions):
        value, size = trace[SUFFIX_TRACE_WIDTH * p], trace[SUFFIX_TRACE_WIDTH * p + 1]
        if value == NGRAM_NONE:
            ok = size == 0
        else:
            ok = value <= top and value % (NGRAM_TRACE_K + 1) <= size <= NGRAM_TRACE_K
        if not ok:
            return (f"position {p} holds ({value}, {size}): not (NGRAM_NONE, 0) nor a match "
                    f"value ≤ {top} with its agreement ≤ a draft length ≤ {NGRAM_TRACE_K}")
    return None


class Trace:
    """The acceptance trace of one request, filled as positions get observed, and beside it
    the draft's confidence at the same positions (``store.records``)."""

    def __init__(self, greedy: bool, max_len: int):
        self.greedy = greedy
        self.max_len = max_len  # positions past it are dropped; the arrays grow as filled
        self.values = bytearray()
        self.confidence = bytearray()

    def put(self, position: int, values, confidence=()) -> None:
        """Set generated positions position, position+1, … (those past ``max_len`` are
        dropped); ``confidence``: quantized top probabilities for the same positions."""
        for arr, vals in ((self.values, values), (self.confidence, confidence)):
            end = min(position + len(vals), self.max_len)
            if end > len(arr):
                arr.extend(bytes([UNOBSERVED]) * (end - len(arr)))
            for i, v in enumerate(vals):
                if 0 <= position + i < end:
                    arr[position + i] = int(v)

    def finish(self, new_tokens: int) -> bytes:
        return _padded(self.values, new_tokens)

    def finish_confidence(self, new_tokens: int) -> bytes:
        return _padded(self.confidence, new_tokens)


def _padded(arr: bytearray, n: int) -> bytes:
    """The first ``n`` positions, unobserved where nothing was put."""
    return bytes(arr[:n]) + bytes([UNOBSERVED]) * max(0, n - len(arr))
