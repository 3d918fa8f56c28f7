"""Suffix decoding: propose the most frequent continuation of the context's longest suffix
found in earlier text — the request's own prompt and output, and the outputs of earlier
requests of its category (Snowflake's Arctic Inference; vLLM's ``method: "suffix"``).

Where prompt lookup (``autospec.ngram``) copies what followed the *latest* occurrence of the
last few tokens of one request, a suffix index counts *every* occurrence it keeps, across
requests, and walks the continuation they agree on most — a walk down a suffix tree: for each
length of the context's suffix found (up to ``max_depth`` tokens), the places it occurs are
the node; the next token most of them share is proposed, the places that continue with it
are kept, and so on, while the path's probability (the share of the node's places that
follow it; a finished text that ends there counts as a place that did not go on) stays at
least ``min_token_prob``, for at most ``max_spec_factor`` × the match length tokens (a long
match earns a long block, as in Arctic) and the k asked for. The draft of the highest score
(the sum of its tokens' path probabilities) is proposed, as Arctic chooses among match
lengths and between its per-request and global trees.

The proposal is a deterministic function of the context and the index, so its q is one-hot:
the rejection rule keeps the output the target's exactly, whatever is proposed.

Structure and cost. An index holds sequences of token ids (a request's own history, or one
earlier output with the tail of its prompt before it) and, per ``seed`` n-gram (its last
``SEED`` tokens), the latest ``OCCURRENCES`` places it was followed by a token. A lookup is one
dictionary probe, a backward comparison of at most ``max_depth`` tokens per place, and a walk
of at most k steps over the places kept: bounded whatever the history's length
(``scripts/ngram_cost.py --suffix`` measures it against a target forward).

Memory. ``SuffixMemory`` (``autospec.suffix_memory``) keeps the earlier outputs per (tenant,
category), each bounded by ``max_requests`` outputs and ``max_tokens`` tokens (the oldest
output is evicted first), all of them together by ``max_bytes`` (the least recently used
category is forgotten first). It lives in the process that generated the text: cross-request
memory holds other requests' text, so it is never written to the store.

Trace. What the proposer would have drafted at every generated position of a request
(``suffix_trace``: match lengths, agreement counts and draft lengths, no tokens) is what the
store keeps for replay. It depends on the category's memory as the request saw it, so it is
computed when the request finishes, before its output joins the memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autospec.ngram import agreement
from autospec.traces import (
    NGRAM_NONE,
    NGRAM_TRACE_K,
    SUFFIX_TRACE_WIDTH,
    encode_trace_value,
)

if TYPE_CHECKING:
    from autospec.suffix_memory import SuffixMemory, TenantMemory

__all__ = ["ARCTIC_PACKAGE", "SuffixIndex", "SuffixMemory", "SuffixSettings", "best_of", "draft_at", "suffix_trace",
           "SEED", "OCCURRENCES"]

SEED = 2  # tokens of the n-gram a lookup starts from (1 where the context is shorter)
# what vLLM's method "suffix" runs on (Arctic Inference's suffix tree): the version its
# config names, which an export to it needs installed beside vLLM
ARCTIC_PACKAGE = "arctic-inference==0.1.1"
OCCURRENCES = 64  # places per seed the index keeps (the latest): a lookup's work is bounded
MIN_BYTES = 1 << 20  # the least max_bytes: room for a category and its working memory


@dataclass(frozen=True)
class SuffixSettings:
    """How the suffix proposer matches and how far it proposes. The defaults are Arctic
    Inference's (and vLLM's ``suffix_decoding_*`` fields); ``max_requests`` and ``max_tokens``
    bound the memory of each category, ``max_bytes`` the memory of every category together.

    max_depth: the longest suffix matched (vLLM: ``suffix_decoding_max_tree_depth``);
    max_spec_factor: a block is at most this × the match length
    (``suffix_decoding_max_spec_factor``); min_token_prob: the walk stops where the share of
    matched places that continue along it drops below this
    (``suffix_decoding_min_token_prob``); min_match: shorter matches propose nothing;
    max_requests / max_tokens: earlier outputs kept per category
    (``suffix_decoding_max_cached_requests``) and their tokens in all; max_bytes: the bytes
    the memory holds, every tenant and category together, counted as allocated (Python objects
    and arrays; an insertion's working memory too); a category alone holds at most a quarter of
    it (``autospec.suffix_memory``)."""

    max_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    min_match: int = 1
    max_requests: int = 1000
    max_tokens: int = 1 << 18
    max_bytes: int = 1 << 27

    def __post_init__(self):
        for name in ("max_depth", "min_match", "max_requests", "max_tokens", "max_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"suffix {name} must be an int >= 1, got {v!r}")
        if self.max_tokens >= 1 << 31:
            raise ValueError(f"suffix max_tokens must be below 2^31, got {self.max_tokens}")
        if self.max_bytes < MIN_BYTES:
            raise ValueError(f"suffix max_bytes must be at least {MIN_BYTES} (1 MiB), got "
                             f"{self.max_bytes}")
        if not self.min_match <= self.max_depth:
            raise ValueError(f"suffix min_match ({self.min_match}) must be at most max_depth "
                             f"({self.max_depth})")
        if not (isinstance(self.max_spec_factor, (int, float)) and self.max_spec_factor > 0
                and math.isfinite(self.max_spec_factor)):
            raise ValueError(f"suffix max_spec_factor must be a number > 0, got "
                             f"{self.max_spec_factor!r}")
        if not (isinstance(self.min_token_prob, (int, float))
                and 0.0 <= self.min_token_prob <= 1.0):
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got "
                             f"{self.min_token_prob!r}")

    @classmethod
    def of(cls, spec) -> SuffixSettings:
        """From wrap's ``suffix=``: True (the defaults), a dict of fields, or settings."""
        if spec is True:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            unknown = set(spec) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"suffix= takes {', '.join(sorted(cls.__dataclass_fields__))};"
                                 f" got {', '.join(sorted(unknown))}")
            return cls(**spec)
        raise TypeError(f"suffix= takes True, a dict of settings or SuffixSettings, got "
                        f"{type(spec).__name__}")


class SuffixIndex:
    """Sequences of token ids and where each seed n-gram was followed by a token in them.

    ``add`` starts a sequence, ``extend`` grows one, ``drop_oldest`` forgets the oldest;
    ``propose(context, k)`` (``draft``: with its score) walks the continuation of
    ``context``'s suffixes found and returns the draft of highest score."""

    def __init__(self, settings: SuffixSettings | None = None):
        self.settings = settings or SuffixSettings()
        self._seqs: dict[int, list[int]] = {}  # sequence id → its tokens
        self._next_id = 0
        # per seed length n (1 and SEED), the seed's key → its places, oldest first; a place
        # is ``sid << 32 | position`` (one int: a tuple per place would triple the memory):
        # seq[position - n : position] is the seed and seq[position] follows it
        self._places: dict[int, dict[int, list[int]]] = {1: {}, SEED: {}}
        self.tokens = 0  # tokens held, every sequence together

    def __len__(self) -> int:
        return len(self._seqs)

    @staticmethod
    def _key(seq: Sequence[int], end: int, n: int) -> int:
        """The seed of n tokens ending before ``end``, as one int (token ids < 2^32)."""
        return seq[end - 1] if n == 1 else (seq[end - 2] << 32) | seq[end - 1]

    def add(self, tokens: Sequence[int], *, finished: bool = False) -> int:
        """A new sequence; returns its id. ``finished``: a whole text (an earlier output): its
        end is a place too, where nothing followed — a suffix that ended texts as often as it
        went on proposes with that much less confidence (as in Arctic's tree, where a node's
        count includes the texts that end there)."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = []
        self.extend(sid, tokens)
        if finished:
            seq, end = self._seqs[sid], sid << 32 | len(tokens)
            if seq:
                _place(self._places[1], seq[-1], end)
            if len(seq) >= 2:
                _place(self._places[SEED], (seq[-2] << 32) | seq[-1], end)
        return sid

    def extend(self, sid: int, new: Sequence[int]) -> None:
        """Tokens appended to sequence ``sid``: each is the continuation of the seeds that
        end just before it."""
        seq = self._seqs[sid]
        one, two = self._places[1], self._places[SEED]
        base = sid << 32
        for tok in new:
            i = len(seq)
            if i:
                _place(one, seq[i - 1], base | i)
                if i >= 2:
                    _place(two, (seq[i - 2] << 32) | seq[i - 1], base | i)
            seq.append(int(tok))
        self.tokens += len(new)

    def drop_oldest(self) -> None:
        """Forget the oldest sequence (its places too)."""
        sid = next(iter(self._seqs))
        seq = self._seqs.pop(sid)
        self.tokens -= len(seq)
        for n, places in self._places.items():
            for i in range(n, len(seq) + 1):  # a finished sequence's end is a place too
                key = self._key(seq, i, n)
                at = places.get(key)
                if at is not None:
                    kept = [p for p in at if p >> 32 != sid]
                    if kept:
                        places[key] = kept
                    else:
                        del places[key]

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens continuing ``context``, the length of the suffix matched). No match
        of at least ``min_match`` tokens: ([], 0)."""
        toks, m, _ = self.draft(context, k)
        return toks, m

    def draft(self, context: Sequence[int], k: int) -> tuple[list[int], int, float]:
        """``propose``, with the draft's score: the sum of its tokens' path probabilities
        (what Arctic compares drafts by)."""
        s = self.settings
        n = len(context)
        if n == 0 or k <= 0:
            return [], 0, 0.0
        # the places after the last token, and after the last two: every place of the
        # second is one of the first, but each list keeps only its latest OCCURRENCES, so
        # the two together reach further back for the longer matches
        at = self._places[1].get(context[-1], ())
        if n >= SEED:
            two = self._places[SEED].get(self._key(context, n, SEED))
            if two:
                at = sorted(set(at).union(two))  # oldest first: ties go to the earliest
        if not at:
            return [], 0, 0.0
        return draft_at(s, self._seqs, at, context, k)


def draft_at(s: SuffixSettings, seqs: Mapping[int, Sequence[int]], at: Sequence[int],
             context: Sequence[int], k: int) -> tuple[list[int], int, float]:
    """The draft from the places ``at`` (``sid << 32 | position``, oldest first) where the
    context's last token was followed, in the sequences ``seqs`` (sid → tokens): each place's
    match, then per match length the walk, the one of highest score kept (``SuffixIndex.
    draft``; the memory's archives gather their places differently and call this too)."""
    # each place's match: how far back the context agrees with the text before it
    n = len(context)
    depth = min(s.max_depth, n)
    matched: list[tuple[int, Sequence[int], int]] = []
    for place in at:
        seq, pos = seqs[place >> 32], place & 0xFFFFFFFF
        m = 1
        top = min(depth, pos)
        while m < top and seq[pos - m - 1] == context[n - m - 1]:
            m += 1
        if m >= s.min_match:
            matched.append((m, seq, pos))
    # every match length found is a node of the suffix tree (the places matching at least
    # that far); each proposes its walk, and the one of highest score wins
    best: tuple[float, int, list[int]] = (0.0, 0, [])
    for length in sorted({m for m, _, _ in matched}, reverse=True):
        found = [(seq, pos) for m, seq, pos in matched if m >= length]
        limit = min(k, int(s.max_spec_factor * length + 1e-6))
        toks, score = _walk(found, limit, s.min_token_prob)
        if score > best[0]:
            best = (score, length, toks)
    return best[2], best[1] if best[2] else 0, best[0]


def _walk(found: list[tuple[Sequence[int], int]], limit: int,
          min_prob: float) -> tuple[list[int], float]:
    """Down the tree from the places ``found``: each step the next token most of them share,
    while the path's probability (the share of the node's places that follow it) stays at
    least ``min_prob``. Returns the tokens and the score, the sum of their probabilities."""
    out: list[int] = []
    total, prob, score = len(found), 1.0, 0.0
    while len(out) < limit and found:
        counts: dict[int, int] = {}
        for seq, pos in found:
            if pos < len(seq):
                tok = seq[pos]
                counts[tok] = counts.get(tok, 0) + 1
        if not counts:
            break
        tok, c = max(counts.items(), key=lambda kv: kv[1])
        prob *= c / total
        if prob < min_prob:
            break
        out.append(tok)
        score += prob
        found = [(seq, pos + 1) for seq, pos in found if pos < len(seq) and seq[pos] == tok]
        total = len(found)
    return out, score


def _place(places: dict[int, list[int]], key: int, place: int) -> None:
    at = places.get(key)
    if at is None:
        places[key] = [place]
    else:
        at.append(place)
        if len(at) > OCCURRENCES:
            del at[0]


def best_of(local: SuffixIndex, memory: SuffixMemory | TenantMemory | None, category: str,
            context: Sequence[int], k: int) -> tuple[list[int], int]:
    """The request's own history and its category's earlier outputs, each asked: the draft of
    higher score proposes (the request's own at a tie), as Arctic chooses between its
    per-request and global trees."""
    a = local.draft(context, k)
    if memory is None:
        return a[:2]
    b = memory.draft(category, context, k)
    return b[:2] if b[2] > a[2] else a[:2]


def suffix_trace(tokens: Sequence[int], prompt_len: int,
                 memory: SuffixMemory | TenantMemory | None,
                 category: str, *, settings: SuffixSettings | None = None,
                 k: int = NGRAM_TRACE_K) -> bytes:
    """Suffix decoding's trace of one request (``autospec.traces``: SUFFIX_TRACE_WIDTH bytes
    per generated position t, ``prompt_len`` ≤ t < len(tokens)): the draft ``best_of`` makes
    there from the request's own index over ``tokens[:t]`` and ``memory``'s index of
    ``category``, walked for ``k`` tokens, as (``encode_trace_value`` of its match and of how
    many of its leading tokens equal ``tokens[t : t + k]``, its length), or (NGRAM_NONE, 0)
    without a draft. The live loop walks the same draft for ``k_max`` tokens: the two are the
    same draft where k_max = ``k`` (the default 16).

    Under greedy verification a suffix block of k' tokens started at t holds min(k', length)
    tokens and accepts min(agreement, k') of them, so replay prices the suffix proposer at
    every position. ``memory`` is read as it stands: call this before the request's output
    joins it. ``settings``: the indices' (default: the memory's). One request index extended
    a token at a time, one ``best_of`` per position: O(len(tokens) − prompt_len) lookups."""
    if not 0 < k <= NGRAM_TRACE_K:
        raise ValueError(f"k must be in 1 … {NGRAM_TRACE_K}, got {k}")
    if settings is None:
        settings = memory.settings if memory is not None else SuffixSettings()
    toks = [int(t) for t in tokens]
    prompt_len = max(0, min(int(prompt_len), len(toks)))
    context = toks[:prompt_len]
    local = SuffixIndex(settings)
    sid = local.add(context)
    out = bytearray(SUFFIX_TRACE_WIDTH * (len(toks) - prompt_len))
    for i, t in enumerate(range(prompt_len, len(toks))):
        draft, matched = best_of(local, memory, category, context, k)
        at = SUFFIX_TRACE_WIDTH * i
        if matched:
            out[at] = encode_trace_value(matched, agreement(draft, toks[t : t + len(draft)]))
            out[at + 1] = len(draft)
        else:
            out[at] = NGRAM_NONE
        local.extend(sid, (toks[t],))
        context.append(toks[t])
    return bytes(out)


def __getattr__(name: str):
    """``SuffixMemory`` lives in ``autospec.suffix_memory`` (which builds on this module)."""
    if name == "SuffixMemory":
        from autospec.suffix_memory import SuffixMemory

        return SuffixMemory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
