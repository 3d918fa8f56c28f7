"""The bookkeeping of autospec inside vLLM, without vLLM: per running request its lookups
(prompt lookup, ``autospec.ngram``; suffix decoding, ``autospec.suffix``), the draft it was
sent and what came back, the category's acceptance, the engine's step costs, and each
request's k every step (``autospec.fleet.vllm_proposer`` adapts vLLM's arrays to ``step``).

One call of ``step`` is one call of vLLM's ``propose``: a ``Row`` per running request, in
vLLM's row order, with the tokens vLLM sampled for it in the step that just ran (empty: the
request is in prefill, or was discarded) and its token row. For each request seen before:

1. its new tokens (they must be exactly the sampled ones: otherwise the row is not the
   request we knew, and its state starts again) go into its lookups;
2. the draft it was sent last step: vLLM accepted ``len(sampled) − 1`` of it (accepted draft
   tokens and one recovered or bonus token), which must be the draft's first tokens; the
   category's acceptance for that proposer counts the block, the request's counters too;
3. the drafts it was *not* sent (a proposer not chosen, or k = 0) are compared with the output
   as it arrives (shadows): evidence of acceptance while speculation is off, so it can come
   back where it pays.

Then each proposer's draft of up to k_max tokens per request, the better proposer per request
(expected tokens at its category's acceptance and match), and each request's k from the step
costs (``vllm_choice.allocate``); k = 0 everywhere where nothing pays. The seconds from the
end of one call to the start of the next are vLLM's step at the batch size and total draft
tokens it ran (``StepCosts``), counted where the step ran only requests already decoding.

A request becomes a ``RequestRecord`` (``on_finish``) when it has its ``max_tokens``, or when
it has left the batch and is ``finished`` (ended by EOS or a stop: seen at the next step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autospec.costs.price import expected_tokens
from autospec.engine.stats import ProposerCounts
from autospec.fleet.vllm_choice import Acceptance, allocate
from autospec.fleet.vllm_costs import StepCosts
from autospec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramIndex, agreement
from autospec.suffix import SuffixIndex, SuffixMemory, SuffixSettings, best_of

log = logging.getLogger(__name__)

__all__ = ["Row", "RequestInfo", "Settings", "Speculator", "PROPOSERS"]

PROPOSERS = ("ngram", "suffix")  # the names autospec's registry gives them


@dataclass(frozen=True)
class Settings:
    """k_max: vLLM's ``num_speculative_tokens``; proposers: which lookups run; min_gain: a step
    speculates where its expected tokens per second beat plain decoding's by this share;
    prior_slope: a draft token's cost as a share of a plain step before any is measured
    (optimistic: speculation is tried, and the engine's costs measured); category: the category
    of a request without a label or a categoriser's; max_requests: request states kept (the
    oldest unfinished ones beyond it are dropped)."""

    k_max: int
    proposers: tuple[str, ...] = PROPOSERS
    min_gain: float = 0.02
    prior_slope: float = 0.05
    category: str = "default"
    max_requests: int = 4096
    suffix: SuffixSettings = field(default_factory=SuffixSettings)

    def __post_init__(self):
        if not 1 <= self.k_max <= 64:
            raise ValueError(f"k_max must be in 1 … 64, got {self.k_max}")
        unknown = set(self.proposers) - set(PROPOSERS)
        if unknown or not self.proposers:
            raise ValueError(f"proposers must be some of {PROPOSERS}, got {self.proposers}")


@dataclass
class RequestInfo:
    """What vLLM knows of a request beyond its tokens (None: not known)."""

    prompt_len: int | None = None
    category: str | None = None  # its label (the request's ``autospec_category``)
    greedy: bool | None = None
    max_tokens: int | None = None


@dataclass
class Row:
    """One running request as vLLM hands it: its id (or any key that stays with it), what was
    sampled for it in the step that ran, its token row (an array or list; the first ``n``
    hold its prompt and output so far), and how to learn the rest (called once, when new)."""

    key: Any
    sampled: Sequence[int]
    tokens: Any
    n: int
    info: Callable[[], RequestInfo] | None = None


class Request:
    """One request's state: its history (the prompt-lookup index holds it), its suffix index,
    the draft it was sent, its shadows, its counters and schedule."""

    def __init__(self, key, tokens: list[int], info: RequestInfo, category: str,
                 category_source: str, speculator: Speculator):
        s = speculator.settings
        self.key, self.info = key, info
        self.category, self.category_source = category, category_source
        self.prompt_len = (info.prompt_len if info.prompt_len is not None
                           and 0 < info.prompt_len <= len(tokens) else len(tokens) - 1)
        self.started = time.time()
        self.last_seen = self.started
        self.ngram = NgramIndex(tokens[: self.prompt_len], max_n=DEFAULT_MAX_N,
                                min_n=DEFAULT_MIN_N)
        self.suffix: SuffixIndex | None = None
        if "suffix" in s.proposers:
            self.suffix = SuffixIndex(s.suffix)
            self.sid = self.suffix.add(tokens[: self.prompt_len])
        self.pending: tuple[str, list[int], int] | None = None  # (proposer, draft, match)
        self.shadows: dict[str, tuple[int, list[int], int]] = {}  # name → (at, draft, match)
        self.counts: dict[str, ProposerCounts] = {name: ProposerCounts() for name in s.proposers}
        self.k_schedule: list[int] = []
        self.accepted_schedule: list[int] = []
        self.proposer_schedule: list[str | None] = []
        self.steps_by_bn: dict[tuple[int, int], list[float]] = {}
        self.batch_max = 1
        self.features: bytes | None = None
        self.predicted_alpha: float | None = None
        self.extend(tokens[self.prompt_len:])

    @property
    def tokens(self) -> list[int]:
        return self.ngram.tokens

    def extend(self, new: Sequence[int]) -> None:
        self.ngram.extend(new)
        if self.suffix is not None:
            self.suffix.extend(self.sid, new)


class Speculator:
    """Every running request's state, the category acceptance and the step costs."""

    def __init__(self, settings: Settings, *, categorize=None, on_finish=None,
                 clock: Callable[[], float] = time.perf_counter):
        self.settings = settings
        self.acceptance = Acceptance(settings.k_max)
        self.costs = StepCosts(prior_slope=settings.prior_slope)
        self.memory = SuffixMemory(settings.suffix) if "suffix" in settings.proposers else None
        self.requests: dict[Any, Request] = {}
        # prompt tokens → (category, predicted acceptance, feature blob) or None
        self.categorize = categorize
        self.on_finish = on_finish  # Request → None, when a finished request leaves
        self.clock = clock
        self._last: tuple[float, int, int, frozenset] | None = None  # end, B, D, keys
        self.counters = {"steps": 0, "rows": 0, "drafts": 0, "draft_tokens": 0,
                         "accepted_tokens": 0, "plain_steps": 0, "lost": 0, "finished": 0,
                         "errors": 0}

    # -- one call of propose ----------------------------------------------------------------
    def step(self, rows: Sequence[Row], finished: Callable[[Any], bool] = lambda key: True,
             ) -> list[list[int]]:
        """The drafts for ``rows`` (one list per row, in order; [] = no speculation)."""
        start = self.clock()
        self.counters["steps"] += 1
        decoding = [r for r in rows if len(r.sampled)]
        keys = frozenset(r.key for r in decoding)
        self._time_last_step(start, keys, len(decoding) == len(rows))
        self._leave({r.key for r in rows}, finished)
        live: list[tuple[int, Request]] = []
        for i, row in enumerate(rows):
            if not len(row.sampled):
                continue
            req = self._advance(row)
            limit = req.info.max_tokens
            if limit is not None and len(req.tokens) - req.prompt_len >= limit:
                del self.requests[row.key]  # its last token: vLLM ends it with this step
                self._finish(req)
            else:
                live.append((i, req))
        out: list[list[int]] = [[] for _ in rows]
        drafted = self._choose(live, out)
        self.counters["rows"] += len(live)
        self._last = (self.clock(), len(live), drafted, frozenset(r.key for _, r in live))
        return out

    def _time_last_step(self, now: float, keys: frozenset, clean: bool) -> None:
        """The step since the last call, where it ran only requests that were decoding (no
        prefill of a new one in it; a request that finished in it ran its last token there)."""
        last, self._last = self._last, None
        if last is None:
            return
        end, batch, drafted, before = last
        if clean and batch and keys <= before:
            seconds = now - end
            self.costs.observe(batch, drafted, seconds)
            width = 1 + round(drafted / batch)  # tokens per request, on average
            for key in keys:
                req = self.requests.get(key)
                if req is not None:
                    req.steps_by_bn.setdefault((batch, width), []).append(seconds)

    def _leave(self, present: set, finished) -> None:
        """Requests no longer in the batch: finished ones are recorded and dropped."""
        for key in [k for k in self.requests if k not in present]:
            if finished(key):
                req = self.requests.pop(key)
                self._finish(req)
        while len(self.requests) > self.settings.max_requests:  # preempted and never back
            self._finish(self.requests.pop(next(iter(self.requests))))

    def _finish(self, req: Request) -> None:
        self.counters["finished"] += 1
        if self.memory is not None and len(req.tokens) > req.prompt_len:
            self.memory.remember(req.category, req.tokens[: req.prompt_len],
                                 req.tokens[req.prompt_len:])
        if self.on_finish is not None:
            self.on_finish(req)

    def finish_all(self) -> None:
        """Record every request still held (the server is stopping)."""
        for key in list(self.requests):
            self._finish(self.requests.pop(key))

    # -- a request's new tokens -------------------------------------------------------------
    def _advance(self, row: Row) -> Request:
        req = self.requests.get(row.key)
        sampled = [int(t) for t in row.sampled]
        if req is not None:
            have = len(req.tokens)
            new = list(map(int, row.tokens[have: row.n])) if row.n > have else []
            if row.n != have + len(sampled) or new != sampled:
                self.counters["lost"] += 1  # not the request we knew: start again
                log.debug("autospec: row %r does not continue its request; state reset",
                          row.key)
                self._finish(self.requests.pop(row.key))
                req = None
        if req is None:
            return self._new(row)
        req.last_seen = time.time()
        self._resolve(req, sampled)
        req.extend(sampled)
        self._shadows(req)
        return req

    def _new(self, row: Row) -> Request:
        tokens = list(map(int, row.tokens[: row.n]))
        info = (row.info() if row.info is not None else None) or RequestInfo()
        category, source = self.settings.category, "default"
        prompt_len = info.prompt_len or len(tokens) - len(row.sampled)
        alpha = features = None
        got = self.categorize(tokens[:prompt_len]) if self.categorize is not None else None
        if got is not None:  # the prompt's features are logged whether labelled or not
            guess, alpha, features = got
            if guess and not info.category:
                category, source = guess, "auto"
        if info.category and _valid(info.category):
            category, source = info.category, "given"
        req = Request(row.key, tokens, RequestInfo(prompt_len, info.category, info.greedy,
                                                   info.max_tokens),
                      category, source, self)
        req.predicted_alpha, req.features = alpha, features
        self.requests[row.key] = req
        return req

    def _resolve(self, req: Request, sampled: list[int]) -> None:
        """The iteration that just ran for ``req``: the draft it was sent, and what came."""
        accepted = len(sampled) - 1
        pending, req.pending = req.pending, None
        if pending is None:
            req.k_schedule.append(0)
            req.accepted_schedule.append(0)
            req.proposer_schedule.append(None)
            if accepted:  # vLLM accepted a draft this proposer never sent
                self.counters["lost"] += 1
            return
        name, draft, match = pending
        if accepted > len(draft) or sampled[:accepted] != draft[:accepted]:
            self.counters["lost"] += 1  # not our draft's outcome: counted nowhere
            accepted = 0
            draft = []
        req.k_schedule.append(len(draft))
        req.accepted_schedule.append(accepted)
        req.proposer_schedule.append(name if draft else None)
        if draft:
            req.counts[name].add(len(draft), accepted)
            self.acceptance.add(req.category, name, match, len(draft), accepted)
            self.counters["accepted_tokens"] += accepted

    def _shadows(self, req: Request) -> None:
        """Each waiting shadow compared with the output so far; settled ones counted."""
        toks = req.tokens
        for name, (at, draft, match) in list(req.shadows.items()):
            seen = toks[at: at + len(draft)]
            same = agreement(draft, seen)
            if same < len(seen) or len(seen) == len(draft):  # a mismatch, or all compared
                self.acceptance.add(req.category, name, match, len(draft), same)
                del req.shadows[name]

    # -- the choice -------------------------------------------------------------------------
    def _drafts(self, req: Request) -> dict[str, tuple[list[int], int]]:
        """Each proposer's draft of up to k_max tokens now: name → (tokens, match)."""
        k, out = self.settings.k_max, {}
        for name in self.settings.proposers:
            t0 = time.perf_counter()
            if name == "ngram":
                draft, match = req.ngram.propose(k)
            else:
                draft, match = best_of(req.suffix, self.memory, req.category, req.tokens, k)
            req.counts[name].seconds += time.perf_counter() - t0
            if draft:
                out[name] = (list(draft), match)
        return out

    def _choose(self, live: list[tuple[int, Request]], out: list[list[int]]) -> int:
        """Each live request's draft into ``out``; the total draft tokens sent."""
        best: list[tuple[str, list[int], int, list[float]] | None] = []
        for _, req in live:
            drafts = self._drafts(req)
            pick = None
            for name, (draft, match) in drafts.items():
                curve = self.acceptance.curve(req.category, name, match)
                value = expected_tokens(curve, len(draft))
                if pick is None or value > pick[0]:
                    pick = (value, name, draft, match, curve)
            best.append(None if pick is None else pick[1:])
            for name, (draft, match) in drafts.items():  # all start as shadows
                if name not in req.shadows:
                    req.shadows[name] = (len(req.tokens), draft, match)
        batch = len(live)
        if not batch:
            return 0
        for _, req in live:
            req.batch_max = max(req.batch_max, batch)
        slope, _ = self.costs.slope(batch)
        curves = [b[3] if b else [] for b in best]
        lengths = [len(b[1]) if b else 0 for b in best]
        ks, _, _ = allocate(curves, lengths, slope, min_gain=self.settings.min_gain)
        if sum(ks) and self.costs.wants_plain(batch):
            ks = [0] * batch
        drafted = 0
        for (i, req), b, k in zip(live, best, ks):
            if b is None or k == 0:
                continue
            name, draft, match, _ = b
            out[i] = draft[:k]
            req.pending = (name, out[i], match)
            shadow = req.shadows.get(name)
            if shadow is not None and shadow[0] == len(req.tokens):
                del req.shadows[name]  # the block itself is the evidence
            drafted += k
        self.costs.ran(batch, drafted)
        if drafted:
            self.counters["drafts"] += sum(1 for k in ks if k)
            self.counters["draft_tokens"] += drafted
        else:
            self.counters["plain_steps"] += 1
        return drafted



def _valid(category: str) -> bool:
    """Whether a request's label is a category the store takes (else it is not used)."""
    from autospec.store.record import check_category

    try:
        check_category(category)
    except ValueError:
        log.warning("autospec: a request's category %r is not one (%s)", category,
                    "ignored: the default category")
        return False
    return True
