"""The state of one engine call: its rows on the host, their tokens and counts on the device.

A call serves B prompts (B = 1 is a batch of one). Each row keeps, on the host, its tokens
(prompt + emitted, read back by the iteration's one sync), its limits and its counters; on
the device the batch keeps every row's sequence in ``tokens`` [B, cap] (row b's first
``n[b]`` entries), the same counts in ``counts``, and the repetition penalty's seen-sets. The
device copies advance on the device from what verification accepted, so no iteration sends
Python data to the device.
"""

from __future__ import annotations

import operator
import sys
import time
import uuid
from dataclasses import dataclass

import torch

from autospec.costs.table import CostTable
from autospec.engine.checks import attention_layout
from autospec.engine.runners import EagerRunner, open_runner, resolve_graphs, static_fits
from autospec.engine.sampling import SamplingConfig, block_presence, process_logits, seen_tokens
from autospec.engine.slots import SlotCache, kv_bytes_per_token
from autospec.engine.stats import LoopStats
from autospec.engine.timing import Clock
from autospec.policies.live import LiveStats
from autospec.traces import TRACE_GREEDY, TRACE_SAMPLED

__all__ = ["Row", "Batch", "CallView", "LoopResult", "fit_vocab", "WHY_FIRST", "WHY_EVERY",
           "WHY_KEPT"]

# the iterations whose decision record (``policies.explain``) is kept for the store when the
# caller did not ask for every one: the first WHY_FIRST, then every WHY_EVERY-th (0-based
# index i kept iff i < WHY_FIRST or i % WHY_EVERY == 0): a request's start, where the policy
# has least to go on, and a steady sample after it, a few records per hundred iterations
WHY_FIRST = 4
WHY_EVERY = 16
# new tokens per row the token buffer holds at first (``Batch.reserve`` grows it)
TOKENS_AHEAD = 256


def _next_sampled(i: int) -> int:
    """The first iteration after ``i`` whose record the sample keeps."""
    j = i + 1
    return j if j < WHY_FIRST else -(-j // WHY_EVERY) * WHY_EVERY


# ``Batch(explain=...)``: which iterations' decision records are kept, as the first kept
# iteration after a given one (None: none is kept)
WHY_KEPT = {"all": lambda i: i + 1, "sample": _next_sampled, None: None}


@dataclass
class LoopResult:
    sequences: torch.Tensor  # [1, L + new]
    stats: LoopStats
    scores: list[torch.Tensor] | None = None  # processed target scores, [V] per new token
    logits: list[torch.Tensor] | None = None  # raw target logits, [V] per new token


def host_tokens(ids: torch.Tensor) -> list[int] | None:
    """``ids`` as ints when they are in host memory (no device read); None on a device."""
    return ids.numpy().tolist() if ids.device.type == "cpu" else None


def fit_vocab(raw: torch.Tensor, vocab: int) -> torch.Tensor:
    """Fit a model's logits to the target's vocabulary. Ids the model lacks get −inf
    (probability 0); ids the target lacks are cut, so the draft never proposes a token the
    target cannot embed. Either way q is still the distribution the draft samples from: the
    rule stays exact."""
    extra = vocab - raw.shape[-1]
    if extra == 0:
        return raw
    if extra < 0:
        return raw[..., :vocab]
    return torch.nn.functional.pad(raw, (0, extra), value=float("-inf"))


class Row:
    """Host-side state of one prompt."""

    def __init__(self, index: int, tokens: list[int] | None, *, length: int, greedy: bool,
                 max_new: int, category: str, live, forecast, prefix, want_scores: bool,
                 want_logits: bool, held=None):
        self.index, self.category, self.live, self.forecast = index, category, live, forecast
        # this request alone, fed as its category's (its counts and rate)
        self.request = LiveStats(discount=1.0)
        self.L = self.n = length
        self.tokens = tokens  # None until the first sync brings a device prompt back
        self.prefix = prefix  # what generate's row holds before the prompt (left padding)
        # generate's whole input row where it differs from prefix + prompt (a mask with holes)
        self.held = held
        self.stats = LoopStats(prompt_tokens=self.L, started_at=time.time(),
                               trace_kind=TRACE_GREEDY if greedy else TRACE_SAMPLED,
                               max_new_tokens=max_new)
        self.scores = [] if want_scores else None
        self.logits = [] if want_logits else None
        self.finished = False
        self.limit = max_new  # tokens the row may generate (``emit.settle`` may lower it)
        self.stop_at: int | None = None  # without EOS: where a stopping criterion first hit
        self.wall_end = 0.0

    @property
    def gen(self) -> int:
        return self.n - self.L

    def as_generate(self, seq: torch.Tensor) -> torch.Tensor:
        """The row's sequence ``seq`` [1, m] (its prompt as the model runs it, then what it
        generated) as generate's row holds it: its input row (left padding, holes), then the
        generated tokens."""
        if self.held is not None:
            return torch.cat([self.held.to(seq.device), seq[:, self.L :]], dim=1)
        if self.prefix is not None and self.prefix.shape[1]:
            return torch.cat([self.prefix.to(seq.device), seq], dim=1)
        return seq


class Batch:
    """Everything one call of the engine holds (see the module docstring)."""

    def __init__(self, target, draft, prompts: list[torch.Tensor], *, sampling: SamplingConfig,
                 policy, max_new_tokens: int, categories, lives, costs=None, forecasts=None,
                 min_new_tokens: int = 0, eos_token_ids: tuple[int, ...] = (),
                 stopping_criteria=None, streamer=None, generator=None, k_max: int = 16,
                 target_context: int | None = None, draft_context: int | None = None,
                 output_scores: bool = False, output_logits: bool = False, row_prefix=None,
                 row_held=None,
                 record_confidence: bool = False, memory=None, options=None,
                 static_cache: bool = False, hidden_states: bool = False,
                 cuda_graphs="auto", explain: str | None = None, processors=None):
        self.t_start = time.perf_counter()
        B = len(prompts)
        self.device = device = prompts[0].device
        self.target, self.draft = target, draft
        self.sampling, self.policy, self.generator = sampling, policy, generator
        self.greedy = not sampling.do_sample
        self.max_new, self.min_new = max_new_tokens, min_new_tokens
        self.criteria, self.streamer = stopping_criteria, streamer
        # the pair's cost table (a call without one keeps its own), and its row at this call's
        # path and the rows running (``view``: made when first read after rows changed)
        self.costs = CostTable() if costs is None else costs
        self._view = None
        self.k_max, self.record_conf = k_max, record_confidence
        self.memory = memory  # the category memory of earlier outputs (None: none)
        self.options = dict(options or {})  # proposer name → its option (``wrap``'s)
        self.target_context, self.draft_context = target_context, draft_context
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.eos_set = set(eos_token_ids)
        self.eos = (torch.tensor(eos_token_ids, dtype=torch.long, device=device)
                    if eos_token_ids else None)
        # each row's logits processor list (by row index), applied per position with its prefix
        # (``engine.processors``) in place of the loop's own processing; None: the loop's own
        self.processors = None if processors is None else list(processors)
        # greedy with no repetition penalty and no EOS ban: processing is only the cast
        self.plain_scores = (self.greedy and not sampling.uses_presence and processors is None
                             and not (min_new_tokens and self.eos is not None))
        self.clock = Clock(device)
        self.iteration = 0
        self.call_batch = B
        self.batch_id = uuid.uuid4().hex if B > 1 else None  # the rows' one call, in the store
        # the decision records kept (``WHY_KEPT[explain]`` says which iterations), each with
        # its "iteration"; keeps_why None: none asked for, no record is built
        if explain not in WHY_KEPT:
            raise ValueError(f"explain must be one of {sorted(map(str, WHY_KEPT))}, "
                             f"got {explain!r}")
        self.keeps_why = WHY_KEPT[explain]
        # the next iteration whose record is kept (never, where none is): one comparison an
        # iteration
        self.why_at = 0 if self.keeps_why is not None else sys.maxsize
        self.decisions: list[dict] = []
        # the prompts' tokens on the host: read at once from host memory; from a device they
        # come back with the first iteration's sync instead of costing a read of their own
        lens = [p.shape[1] for p in prompts]
        flat = host_tokens(torch.cat([p[0] for p in prompts]))
        self.pending = None if flat is not None else torch.cat([p[0] for p in prompts])
        starts = [sum(lens[:b]) for b in range(B)]
        self.all_rows = [
            Row(b, None if flat is None else flat[starts[b] : starts[b] + lens[b]],
                length=lens[b], greedy=self.greedy,
                max_new=max_new_tokens, category=categories[b], live=lives[b],
                forecast=None if forecasts is None else forecasts[b],
                prefix=None if row_prefix is None else row_prefix[b],
                held=None if row_held is None else row_held[b],
                want_scores=output_scores, want_logits=output_logits)
            for b in range(B)]
        self.rows = list(self.all_rows)  # the rows still running, in batch order
        self._running()
        # sized for what the first iterations can reach, grown on demand (``reserve``): a
        # request's max_new_tokens is a bound, not a size (servers pass a client's through)
        cap = max(lens) + min(max_new_tokens, TOKENS_AHEAD) + k_max + 2
        self.tokens = torch.zeros(B, cap, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            self.tokens[b, : lens[b]] = p[0]
        # each row's token count on the device, advanced there from what was accepted (a call
        # of one row keeps it on the host alone: ``n_dev`` builds it where it is read)
        self.counts = (torch.tensor(lens, dtype=torch.long, device=device) if B > 1
                       else None)  # once per call
        self.L_dev = torch.tensor(lens, dtype=torch.long, device=device)
        self.limit_dev = torch.full_like(self.L_dev, max_new_tokens)  # each row's own limit
        self.cols = torch.arange(k_max + 1, device=device)  # column offsets, made once
        self.seen = None
        if sampling.uses_presence:
            self.seen = torch.cat([seen_tokens(p, self.vocab) for p in prompts])
        if streamer is not None:
            streamer.put(prompts[0].cpu())
        self.graphs = resolve_graphs(cuda_graphs, device) if static_cache else None
        # static caches serve batch 1, for requests that cannot run past a model's positions
        # (a static cache is allocated whole; a longer request runs eager, said once)
        # the target's hidden states, for a proposer that drafts from them: eager forwards
        self.static = (bool(static_cache) and B == 1 and not hidden_states
                       and all(static_fits(m, max(lens) + max_new_tokens + 1)
                               for m in (target, draft) if m is not None))
        self.peak_kv = 0
        self.proposers: dict = {}  # name → proposer (``engine.generate`` opens them)
        self.opened()
        self.known = lens  # each running row's tokens as the iteration starts (``step``)
        self.target_slots = self.open_slots(target, max(lens) + max_new_tokens + 1)

    # -- set-up ------------------------------------------------------------------------------
    def open_slots(self, model, need: int, map_ids=None) -> SlotCache:
        """A slot cache for ``model`` over the call's rows: a static runner at batch 1 when
        asked for (where the model allows one), else transformers' DynamicCache."""
        runner = (open_runner(model, need, static=True, graphs=self.graphs) if self.static
                  else EagerRunner(model))
        return SlotCache(runner, len(self.rows), self.device, attention_layout(model),
                         map_ids=map_ids, kv_per_token=kv_bytes_per_token(model))

    def reserve(self, n: int) -> None:
        """Room for ``n`` tokens in every row of ``tokens`` (doubling it when short): an
        iteration reserves what its rows can reach before writing (a host comparison)."""
        cap = self.tokens.shape[1]
        if n > cap:
            grown = torch.zeros(self.tokens.shape[0], max(n, 2 * cap), dtype=torch.long,
                                device=self.device)
            grown[:, :cap] = self.tokens
            self.tokens = grown

    def opened(self) -> None:
        """The call's proposers are open (``proposers``, by name, the model proposer first):
        what every iteration asks of them, looked up once per call."""
        self.proposer_names: tuple[str, ...] = tuple(self.proposers)
        self.model = next((n for n, p in self.proposers.items() if p.kind == "model"), None)
        self.lookups = tuple((n, p) for n, p in self.proposers.items() if n != self.model)
        self.whole = tuple(n for n, p in self.lookups if p.whole_draft)
        self.wants_hidden = any("hidden_states" in p.needs for p in self.proposers.values())
        if self.wants_hidden and self.static:
            raise ValueError("a proposer needs the target's hidden states: open it in a call "
                             "made with hidden_states=True")

    def slot_caches(self) -> list[SlotCache]:
        caches = [self.target_slots]
        caches += [c for p in self.proposers.values() for c in getattr(p, "caches", ())]
        return caches

    @property
    def path(self) -> str:
        paths = {c.runner.path for c in self.slot_caches()}
        return paths.pop() if len(paths) == 1 else "/".join(c.runner.path
                                                             for c in self.slot_caches())

    def track_memory(self) -> None:
        """The KV bytes the call holds now, into its peak (a call of one row reads its
        caches' high-water marks at the end instead)."""
        if self.counts is not None:
            self.peak_kv = max(self.peak_kv, sum(c.kv_bytes for c in self.slot_caches()))

    def receive_prompts(self, values: list[int]) -> None:
        """The prompts, read back with the first iteration's sync."""
        at = 0
        for r in self.all_rows:
            r.tokens = values[at : at + r.L]
            at += r.L
        self.pending = None

    @property
    def view(self):
        """The pair's costs at this call's execution path and the rows running (the
        ``CostRow`` the policy reads and the accounting feeds this iteration; one row: its
        prompt's context band's)."""
        if self._view is None:
            rows = self.rows
            self._view = self.costs.at(self.path, len(rows),
                                       context=rows[0].L if len(rows) == 1 else 0)
        return self._view

    def _running(self) -> None:
        """What accounting reads of the running rows, kept as they change (rows leave)."""
        self._view = None
        self.lives = [r.live for r in self.rows]
        self.requests = [r.request for r in self.rows]
        self.row_stats = [r.stats for r in self.rows]

    # -- per iteration -----------------------------------------------------------------------
    def keep_why(self, record: dict) -> None:
        """This iteration's decision record, kept with its index (``decisions``); the next
        kept iteration set."""
        record["iteration"] = self.iteration
        self.decisions.append(record)
        self.why_at = self.keeps_why(self.iteration)

    def gens(self) -> list[int]:
        return [r.gen for r in self.rows]

    def process(self, raw: torch.Tensor, offset: int, seen=None, block=None,
                before=None) -> torch.Tensor:
        """raw [B, npos, V] → processed scores, as generate processes them at each position:
        row b's position j comes after gen_b + offset + j generated tokens (EOS is banned
        before min_new_tokens) and, for the repetition penalty, has seen ``seen`` [B, V] plus
        ``block``'s tokens before it. ``before``: the tokens between the rows' own and position
        0 (a draft's proposals so far, ``offset`` tensors [B]), read by processor lists alone."""
        if raw.shape[-1] != self.vocab:
            raw = fit_vocab(raw, self.vocab)
        if self.processors is not None:
            return self._process_each(raw, offset, block, before)
        if self.plain_scores:  # greedy, nothing to ban or penalise: the scores are the logits
            return raw.float()
        npos = raw.shape[1]
        banned = None
        if self.min_new and self.eos is not None and min(self.gens()) + offset < self.min_new:
            g = (self.n_dev - self.L_dev)[:, None] + offset + torch.arange(npos,
                                                                            device=self.device)
            banned = torch.zeros(raw.shape[0], npos, self.vocab, dtype=torch.bool,
                                 device=self.device)
            banned[:, :, self.eos] = (g < self.min_new)[:, :, None]
        pos_seen = None if seen is None else block_presence(seen, block, npos)
        return process_logits(raw, self.sampling, seen=pos_seen, banned=banned)

    def _process_each(self, raw, offset: int, block, before) -> torch.Tensor:
        """``process`` by each row's processor list, position by position: row b's position j
        comes after its left padding, its tokens, ``before``'s row and ``block``'s first j.
        A negative offset (a draft's catch-up over emitted positions, read for its trace
        alone) is scored unprocessed: processors are never shown a prefix generate did not
        reach, nor asked twice about positions already emitted."""
        from autospec.engine.processors import apply_lists

        if offset < 0:
            return raw.float()
        prefixes = []
        for b in range(len(self.rows)):
            prefix = self.row_prefix(b)
            if offset and before:
                prefix = torch.cat([prefix, torch.stack([t[b] for t in before[:offset]])])
            prefixes.append(prefix)
        return apply_lists([self.processors[r.index] for r in self.rows], prefixes, raw, block)

    def row_prefix(self, b: int) -> torch.Tensor:
        """Running row b's sequence as generate holds it (``Row.as_generate``): every token it
        knows as the iteration starts."""
        return self.rows[b].as_generate(self.tokens[b : b + 1, : self.known[b]])[0]

    @property
    def n_dev(self) -> torch.Tensor:
        """[B] each row's token count on the device."""
        if self.counts is not None:
            return self.counts
        return torch.full((1,), self.rows[0].n, dtype=torch.long, device=self.device)

    def room(self, k: int) -> torch.Tensor:
        """[B] each row's block length at most k, never past what the row may generate."""
        return (self.limit_dev - (self.n_dev - self.L_dev) - 1).clamp(0, k)

    def write(self, block: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor | None,
              host: list[int]) -> None:
        """The block's accepted tokens and the next token ``nxt`` into each row's sequence,
        on the device (entries past a row's new end are overwritten later), and the counts
        moved; nxt None: ``block`` holds it right after each row's accepted tokens (greedy's
        argmax). ``host``: each row's accepted count, read back (a call of one row writes by
        slices)."""
        k = block.shape[1]
        if self.counts is None:
            n, m = self.rows[0].n, host[0]
            if nxt is None:
                self.tokens[:, n : n + m + 1] = block[:, : m + 1]
            else:
                if m:
                    self.tokens[:, n : n + m] = block[:, :m]
                self.tokens[:, n + m] = nxt
        else:
            if k:
                self.tokens.scatter_(1, self.counts[:, None] + self.cols[:k], block)
            end = self.counts + accepted  # [B] where the next token goes
            if nxt is not None:
                self.tokens.scatter_(1, end[:, None], nxt[:, None])
            self.counts = end + 1
        if self.seen is not None:
            if nxt is None:
                emitted, kept = block, self.cols[:k] <= accepted[:, None]
            else:
                emitted = torch.cat([block, nxt[:, None]], dim=1)
                kept = torch.ones(emitted.shape, dtype=torch.bool, device=self.device)
                kept[:, :k] = self.cols[:k] < accepted[:, None]  # the accepted drafts, then nxt
            hits = torch.zeros(self.seen.shape, dtype=torch.long, device=self.device)
            hits.scatter_reduce_(1, emitted, kept.long(), reduce="amax")
            self.seen |= hits.bool()

    def leave(self) -> list[Row]:
        """Rows that finished leave the batch: dropped from every cache and device tensor."""
        keep = [b for b, r in enumerate(self.rows) if not r.finished]
        if len(keep) == len(self.rows):
            return self.rows
        self.rows = [self.rows[b] for b in keep]
        self._running()
        if not keep:
            return self.rows
        index = torch.tensor(keep, device=self.device)  # once per row that leaves
        for cache in self.slot_caches():
            cache.select(keep, index)
        for p in self.proposers.values():
            p.select(keep, index)
        self.tokens, self.counts, self.L_dev, self.limit_dev = (
            t[index] for t in (self.tokens, self.counts, self.L_dev, self.limit_dev))
        if self.seen is not None:
            self.seen = self.seen[index]
        return self.rows

    # -- the end -----------------------------------------------------------------------------
    def results(self) -> list[LoopResult]:
        if self.streamer is not None:
            self.streamer.end()
        if self.counts is None:
            self.peak_kv = sum(c.peak * c.kv_per_token for c in self.slot_caches())
        out = []
        path = self.path
        for r in self.all_rows:
            st = r.stats
            st.new_tokens = r.gen
            st.batch_size = self.call_batch
            st.peak_kv_bytes = self.peak_kv
            st.cache_repacks = sum(c.repacks for c in self.slot_caches())
            st.wall_s = (r.wall_end or time.perf_counter()) - self.t_start
            st.path = path
            if self.keeps_why is not None:  # the records of the iterations the row ran in
                st.decisions = [d for d in self.decisions if d["iteration"] < st.iterations]
            st.model, st.batch_id, st.proposers = self.model, self.batch_id, self.proposer_names
            for p in self.proposers.values():  # each its trace, its extras
                p.finish(r, st)
            seq = torch.tensor(r.tokens, dtype=torch.long)[None].to(self.device)
            out.append(LoopResult(sequences=seq, stats=st, scores=r.scores, logits=r.logits))
        return out

    def release(self) -> None:
        for cache in self.slot_caches():
            cache.release()


class CallView:
    """What a proposer may read and use of its engine call (a ``Batch``), and nothing else.

    The call: ``rows`` (running, in batch order) and ``all_rows`` (``Row``: its ``index``,
    ``category``, ``tokens``, ``L``, ``n``, ``limit``), ``device``, ``k_max``, ``greedy``,
    ``sampling``, ``generator``, ``max_new``, ``record`` (the call records for a store:
    traces and confidences are wanted), ``memory`` (the category memory of earlier outputs),
    ``options`` (by proposer name, what ``wrap`` was given for it), ``policy``, the models
    ``target`` and ``draft``. The device state a model proposer drafts from: ``tokens``
    [B, cap] (every row's sequence), ``counts``, ``known``, ``n_dev``, ``seen``, ``clock``,
    ``process`` (generate's logits processing), ``room`` (each row's block limit) and
    ``open_slots`` (a slot cache of its own)."""

    # what stays as it is for the whole call: read once, plain attributes (the draft model
    # reads several every iteration); the rest follows the batch (rows leave, buffers grow)
    FIXED = ("device", "k_max", "greedy", "sampling", "generator", "max_new", "memory",
             "options", "policy", "target", "draft", "clock", "process", "room", "open_slots",
             "all_rows")
    LIVE = ("rows", "tokens", "counts", "known", "n_dev", "seen")
    __slots__ = ("_batch", "record", *FIXED)

    def __init__(self, batch: Batch):
        self._batch = batch
        self.record = batch.record_conf
        for name in self.FIXED:
            setattr(self, name, getattr(batch, name))


for _name in CallView.LIVE:
    setattr(CallView, _name, property(operator.attrgetter(f"_batch.{_name}")))
del _name
