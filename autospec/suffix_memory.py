"""Suffix decoding's memory of earlier outputs (``SuffixMemory``): per (tenant, category), the
outputs of earlier requests (each after the last ``max_depth`` tokens of its prompt), all of
them within one bound in bytes.

Whose text. The memory holds other requests' outputs, and what it proposes shows in what a
caller can observe (acceptance counters, latency): a request that drafts well from it learns
that an earlier request of its key emitted the continuation it was heading for. Requests of
one tenant (``tenant=`` on ``generate``, or the controller's) draft only from that tenant's
outputs; requests without one share the memory per category, as before tenants existed.

Layout. One *archive* per key holds each output's tokens (``array('I')``, 4 bytes a token)
and the places where a seed was followed (``autospec.suffix``: after the last token, and
after the last two; a finished output's end is a place too), as int64 arrays sorted by the
seed's key, in a few *levels*, oldest first: a new output is a level of its own, and the two
newest merge while the newer is at least as large as the older (a binary counter: about
log2 levels, each place merged about log2 times). A lookup takes, per seed, the latest
``OCCURRENCES`` places by one binary search per level, then matches and walks as
``SuffixIndex`` does (``autospec.suffix.draft_at``): the same drafts from the same outputs.

The bound. Every byte is counted as allocated: the arrays, the containers, each archive's own
objects (``sys.getsizeof``), and the working memory an insertion will use (its output's new
level and the merge it triggers), reserved before it builds. Where the total would pass
``max_bytes`` the least recently used archive (a lookup or an insertion uses it) is forgotten
whole; within an archive the oldest outputs go first (past ``max_requests``, ``max_tokens``,
or a quarter of ``max_bytes``, which leaves room for its merges). Places of forgotten outputs
are dropped when their level merges, and every level is rebuilt without them once they are
as many as the places kept. An insertion whose working memory cannot be reserved (every
other archive busy with its own) is skipped and counted: the memory is a cache, the proposer
only proposes, and verification keeps the output exact whatever it holds.

Threads. A lookup takes no lock: it reads its archive's state, an immutable snapshot that an
insertion replaces whole once it has built the next one aside. Insertions into one archive
take its own lock, one at a time; the memory's lock guards the map of archives and the byte
count, for bookkeeping only. No lookup waits on an insertion, in its archive or another.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autospec.suffix import OCCURRENCES, SEED, SuffixSettings, draft_at

log = logging.getLogger(__name__)

__all__ = ["SuffixMemory", "TenantMemory", "check_tenant", "TOKEN_LIMIT"]

TOKEN_LIMIT = 1 << 31  # token ids the memory keeps: a seed of two is one int64 key
_ONE = 1 << 62  # a one-token seed's key is _ONE | token; a two-token seed's a << 31 | b
_SID_LIMIT = 1 << 31  # outputs one archive numbers before it starts over
# bytes of an archive's own objects beyond what ``_Archive.fixed`` measures (its map entry,
# its state's empty containers, counters): measured with tracemalloc, with room to spare
_ARCHIVE_SLACK = 1024
# working memory an insertion allocates, per place (tracemalloc): building its output's level
# (keys, order, the sorted copies kept: 24 bytes at the peak) and per place of a merge
# (concatenation, mask, order, the merged copies kept: 41 bytes at the peak, beside the
# previous merge's level it reads: 16 more), with room to spare
_BUILD_BYTES = 32
_MERGE_BYTES = 64
# a category's share of max_bytes, in tokens: 4 bytes a token, 2 places of 16 bytes each,
# and as many places of forgotten outputs before a rebuild drops them
_CATEGORY_SHARE = 4
_TOKEN_BYTES = 4 + 2 * 16 * 2


def check_tenant(tenant: object) -> str:
    """A tenant is named as a category is (``store.record.check_category``); returns it."""
    from autospec.store.record import check_category

    try:
        return check_category(tenant)
    except ValueError as e:
        raise ValueError(f"tenant= is named as a category is: {e}") from None


@dataclass(frozen=True, slots=True)
class _State:
    """One archive as a lookup reads it; never changed once published."""

    seqs: dict[int, array]  # sid → the output's tokens, oldest first
    levels: tuple[tuple[np.ndarray, np.ndarray, int], ...]  # (keys, places, top), oldest first
    floor: int  # places below it are of forgotten outputs (the oldest sid kept << 32)


_EMPTY = _State({}, (), 0)


class _Archive:
    """One (tenant, category)'s outputs. ``state`` is what lookups read; ``writer`` orders
    insertions; ``pins`` (insertions in flight or waiting) keeps it from being forgotten."""

    __slots__ = ("key", "state", "writer", "used", "bytes", "tokens", "stale", "next_sid",
                 "pins")

    def __init__(self, key: tuple[str | None, str]):
        self.key = key
        self.state = _EMPTY
        self.writer = threading.Lock()
        self.used = 0  # the memory's clock at its last lookup or insertion
        self.tokens = 0  # tokens held
        self.stale = 0  # places in its levels of forgotten outputs
        self.next_sid = 0
        self.pins = 0
        self.bytes = self.fixed()

    def fixed(self) -> int:
        """The bytes of the archive's own objects, whatever it holds."""
        return (sys.getsizeof(self) + sys.getsizeof(self.writer) + sys.getsizeof(self.key)
                + sum(sys.getsizeof(x) for x in self.key if x is not None) + _ARCHIVE_SLACK)

    def held(self, st: _State, seq_bytes: int) -> int:
        """The bytes of ``st``: its outputs (``seq_bytes``), their map and its levels."""
        levels = sum(sys.getsizeof(lv) + sum(map(sys.getsizeof, lv)) for lv in st.levels)
        return (self.fixed() + sys.getsizeof(st) + sys.getsizeof(st.seqs) + seq_bytes
                + sys.getsizeof(st.levels) + levels)

    def draft(self, settings: SuffixSettings, context: Sequence[int],
              k: int) -> tuple[list[int], int, float]:
        """``SuffixIndex.draft`` over the archive's outputs."""
        st = self.state
        n = len(context)
        if not st.seqs or n == 0 or k <= 0:
            return [], 0, 0.0
        last = context[-1]
        if not 0 <= last < TOKEN_LIMIT:
            return [], 0, 0.0
        seeds = [_ONE | last]
        if n >= SEED and 0 <= context[-2] < TOKEN_LIMIT:
            seeds.append((context[-2] << 31) | last)
        # per seed its key and the next: the ends of its run of places in a level
        query = np.array([x for key in seeds for x in (key, key + 1)], dtype=np.int64)
        found: list[list[int]] = [[] for _ in seeds]
        need = [OCCURRENCES] * len(seeds)
        for keys, places, _ in reversed(st.levels):  # newest first: the latest places
            ends = keys.searchsorted(query).tolist()
            for j in range(len(seeds)):
                a, b = ends[2 * j], ends[2 * j + 1]
                if not need[j] or a == b:
                    continue
                got = places[max(a, b - need[j]) : b].tolist()  # ascending: oldest first
                live = [p for p in got if p >= st.floor]
                # a forgotten output's places come before every kept one, here and in the
                # older levels: the places of this seed end here
                need[j] = 0 if len(live) < len(got) else need[j] - len(live)
                found[j] = live + found[j]
            if not any(need):
                break
        at = found[0]
        if len(found) > 1 and found[1]:
            at = sorted(set(at).union(found[1]))  # oldest first: ties go to the earliest
        if not at:
            return [], 0, 0.0
        return draft_at(settings, st.seqs, at, context, k)


def _level(tokens: array, sid: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One output's places, sorted by seed key (a stable sort: a key's places stay in the
    order of their positions): after position i - 1 (the key of tokens[i - 1]) and after
    i - 2, i - 1, for every i up to len(tokens), its end included; and the highest place."""
    t = np.frombuffer(tokens, dtype=np.uint32).astype(np.int64)
    n = len(t)
    keys = np.empty(2 * n - 1, dtype=np.int64)
    np.bitwise_or(t, _ONE, out=keys[:n])
    np.left_shift(t[:-1], 31, out=keys[n:])
    keys[n:] |= t[1:]
    del t
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    # the place of entry j: position j + 1 (a one-token seed), j - n + 2 (a two-token one)
    order += 1
    order[order > n] -= n - 1
    order |= sid << 32
    return keys, order, (sid << 32) | n


def _merge(levels: Sequence[tuple[np.ndarray, np.ndarray, int]],
           floor: int) -> tuple[tuple[np.ndarray, np.ndarray, int], int]:
    """Levels (oldest first) as one, without the places below ``floor``; and how many were
    dropped. The stable sort keeps a key's places oldest first."""
    keys = np.concatenate([k for k, _, _ in levels])
    places = np.concatenate([p for _, p, _ in levels])
    keep = places >= floor
    dropped = len(places) - int(np.count_nonzero(keep))
    if dropped:
        keys, places = keys[keep], places[keep]
    del keep
    order = np.argsort(keys, kind="stable")
    return (keys[order], places[order], max(top for _, _, top in levels)), dropped


def _plan(sizes: list[int], new: int, rebuild: bool) -> list[int]:
    """The sizes of the merges an insertion of ``new`` places makes into levels of
    ``sizes`` (oldest first): every level at once where it rebuilds, else the two newest
    while the newer is at least as large (an upper bound: merges drop forgotten places)."""
    if rebuild:
        return [sum(sizes) + new]
    sizes, merges = sizes + [new], []
    while len(sizes) >= 2 and sizes[-1] >= sizes[-2]:
        merged = sizes.pop() + sizes.pop()
        merges.append(merged)
        sizes.append(merged)
    return merges


class SuffixMemory:
    """The outputs of earlier requests, per (tenant, category), within ``settings.max_bytes``
    in all (module docstring). Thread-safe: lookups never wait on insertions; requests of one
    controller may finish on several threads.

    ``draft``/``propose`` look up, ``remember`` inserts, each for one category of one tenant
    (None: requests without a tenant); ``tenant(name)`` is the memory as one tenant's
    requests see it. ``bytes`` is what it holds and has reserved, ``evicted`` the outputs it
    forgot, ``skipped`` the insertions it could not make room for."""

    def __init__(self, settings: SuffixSettings | None = None):
        self.settings = settings or SuffixSettings()
        self._archives: dict[tuple[str | None, str], _Archive] = {}
        self._lock = threading.Lock()  # the map and the counts below; bookkeeping only
        self._clock = itertools.count(1)
        self._held = 0  # the archives' bytes, every one (``_Archive.bytes``)
        self._reserved = 0
        self.evicted = 0
        self.skipped = 0
        s = self.settings
        # what the memory counts stays within 7/8 of the bound: the allocator's own
        # overhead and fragmentation (what RSS shows beyond the bytes allocated) take the rest
        self._limit = s.max_bytes - s.max_bytes // 8
        self._cap = max(1, min(s.max_tokens, self._limit // _CATEGORY_SHARE // _TOKEN_BYTES))

    @property
    def bytes(self) -> int:
        """The bytes held (the archives and their map) and reserved by insertions in flight:
        at most 7/8 of ``settings.max_bytes`` (the allocator's overhead takes the rest)."""
        return self._held + self._reserved + sys.getsizeof(self._archives)

    def tenant(self, tenant: str | None) -> SuffixMemory | TenantMemory:
        """The memory as requests of ``tenant`` see it (None: this memory, untenanted)."""
        return self if tenant is None else TenantMemory(self, check_tenant(tenant))

    # -- lookups ----------------------------------------------------------------------------
    def propose(self, category: str, context: Sequence[int], k: int, *,
                tenant: str | None = None) -> tuple[list[int], int]:
        """``SuffixIndex.propose`` on the category's earlier outputs (([], 0): none yet)."""
        return self.draft(category, context, k, tenant=tenant)[:2]

    def draft(self, category: str, context: Sequence[int], k: int, *,
              tenant: str | None = None) -> tuple[list[int], int, float]:
        """``SuffixIndex.draft`` on the category's earlier outputs (of ``tenant``'s requests).
        Takes no lock."""
        arc = self._archives.get((tenant, category))
        if arc is None:
            return [], 0, 0.0
        arc.used = next(self._clock)
        return arc.draft(self.settings, context, k)

    def categories(self, tenant: str | None = None) -> dict[str, tuple[int, int]]:
        """category → (outputs held, tokens held), for ``tenant``'s requests."""
        with self._lock:
            arcs = [a for (t, _), a in self._archives.items() if t == tenant]
        return {a.key[1]: (len(a.state.seqs), a.tokens) for a in arcs}

    # -- insertions -------------------------------------------------------------------------
    def remember(self, category: str, prompt: Sequence[int], output: Sequence[int], *,
                 tenant: str | None = None) -> None:
        """One finished request's output, with the last ``max_depth`` prompt tokens before it
        (what its first tokens followed), into its (tenant, category)'s archive."""
        if not len(output):
            return
        key = (tenant, category)
        with self._lock:
            arc = self._archives.get(key)
            if arc is None:
                arc = self._archives[key] = _Archive(key)
                self._held += arc.bytes
            arc.pins += 1  # not forgotten while an insertion waits for it or runs
            arc.used = next(self._clock)
        try:
            with arc.writer:  # insertions into this archive, one at a time; lookups go on
                self._insert(arc, prompt[-self.settings.max_depth:], output)
        finally:
            with self._lock:
                arc.pins -= 1

    def _insert(self, arc: _Archive, tail: Sequence[int], output: Sequence[int]) -> None:
        """``tail`` + ``output`` (their last ``_cap`` tokens) as the archive's newest output:
        plan the outputs it pushes out and the merges it makes, reserve their working memory,
        build the next state aside, publish it, and count what it holds."""
        s = self.settings
        n = min(len(tail) + len(output), self._cap)
        st, held_tokens, stale = arc.state, arc.tokens, arc.stale
        if arc.next_sid >= _SID_LIMIT:  # numbered out: start over (a cache, never wrong)
            st, held_tokens, stale, arc.next_sid = _EMPTY, 0, 0, 0
        sid = arc.next_sid
        # the oldest outputs this one pushes out: their places (2 m - 1 each) turn stale
        order = list(st.seqs)  # oldest first
        held_tokens += n
        gone = 0
        while gone < len(order) and (len(order) - gone >= s.max_requests
                                     or held_tokens > self._cap):
            m = len(st.seqs[order[gone]])
            held_tokens -= m
            stale += 2 * m - 1
            gone += 1
        kept = order[gone:]
        floor = (kept[0] if kept else sid) << 32
        live = [lv for lv in st.levels if lv[2] >= floor]  # levels wholly forgotten: dropped
        stale -= sum(len(k) for k, _, _ in st.levels) - sum(len(k) for k, _, _ in live)
        new = 2 * n - 1
        places = sum(len(k) for k, _, _ in live) + new
        rebuild = stale > places - stale  # as many forgotten places as kept ones
        merges = _plan([len(k) for k, _, _ in live], new, rebuild)
        need = (5 * n + 64 + sys.getsizeof(st.seqs) + _BUILD_BYTES * new
                + _MERGE_BYTES * max(merges, default=0))
        if not self._reserve(arc, need):
            return
        try:
            skip = len(tail) + len(output) - n
            # token by token in Python: the interpreter lets lookups in between
            tokens = array("I", (int(t) for t in itertools.islice(
                itertools.chain(tail, output), skip, None)))
            if np.frombuffer(tokens, dtype=np.uint32).max() >= TOKEN_LIMIT:
                log.debug("autospec: a token id >= 2^31: the output is not remembered")
                return
            seqs = {i: st.seqs[i] for i in kept}
            seqs[sid] = tokens
            levels = live + [_level(tokens, sid)]
            if rebuild:
                merged, dropped = _merge(levels, floor)
                levels, stale = [merged], stale - dropped
            else:
                while len(levels) >= 2 and len(levels[-1][0]) >= len(levels[-2][0]):
                    merged, dropped = _merge(levels[-2:], floor)
                    levels[-2:] = [merged]
                    stale -= dropped
            seq_bytes = sum(sys.getsizeof(v) for v in seqs.values())
            nxt = _State(seqs, tuple(levels), floor)
            del levels, live, st
            arc.state = nxt  # published: lookups read it from here on
            arc.next_sid, arc.tokens, arc.stale = sid + 1, held_tokens, stale
            held = arc.held(nxt, seq_bytes)
            with self._lock:
                self.evicted += gone
                self._held += held - arc.bytes
                arc.bytes = held
        finally:
            with self._lock:
                self._reserved -= need
                self._make_room(arc, 0)

    def _reserve(self, arc: _Archive, need: int) -> bool:
        """Reserve ``need`` bytes for an insertion into ``arc``, forgetting the least recently
        used other archives as it must; False (counted) where it cannot."""
        with self._lock:
            if not self._make_room(arc, need):
                self.skipped += 1
                log.debug("autospec: no room in the suffix memory for an insertion of %d "
                          "bytes (%d held, %d reserved): skipped", need, self._held,
                          self._reserved)
                return False
            self._reserved += need
            return True

    def _make_room(self, keep: _Archive, need: int) -> bool:
        """(Under the lock.) Forget the least recently used archives not in use (never
        ``keep``) until ``need`` more bytes fit; whether they do."""
        limit = self._limit - need
        if self.bytes <= limit:
            return True
        idle = sorted((a for a in self._archives.values() if a is not keep and not a.pins),
                      key=lambda a: a.used)
        for arc in idle:
            del self._archives[arc.key]
            self._held -= arc.bytes
            self.evicted += len(arc.state.seqs)
            if self.bytes <= limit:
                return True
        return False


class TenantMemory:
    """A ``SuffixMemory`` as one tenant's requests see it: their outputs, never another
    tenant's (what the suffix proposer and ``suffix_trace`` are handed)."""

    def __init__(self, memory: SuffixMemory, tenant: str):
        self.memory, self.name = memory, tenant

    @property
    def settings(self) -> SuffixSettings:
        return self.memory.settings

    def draft(self, category: str, context: Sequence[int],
              k: int) -> tuple[list[int], int, float]:
        return self.memory.draft(category, context, k, tenant=self.name)

    def propose(self, category: str, context: Sequence[int], k: int) -> tuple[list[int], int]:
        return self.memory.propose(category, context, k, tenant=self.name)

    def remember(self, category: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.memory.remember(category, prompt, output, tenant=self.name)

    def categories(self) -> dict[str, tuple[int, int]]:
        return self.memory.categories(self.name)
