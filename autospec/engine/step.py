"""One iteration of the exact draft → verify loop, for every batch size.

1. Decide: the policy chooses k and a proposer; each row gets its block's proposer and length
   (``decide.py``).
2. Propose: every proposer ``decide`` assigned rows to drafts on the device; lookup blocks
   overlay their rows on the draft model's (``proposers/``).
3. Verify: the target scores each row's catch-up and block in one forward over its slot cache
   (``slots.py``), and the rejection rule keeps, per row, a prefix of the block plus one
   recovered or bonus token (``verify.py``; greedy is its one-hot limit).
4. The iteration's one host sync: accepted counts, next tokens, the block, trace values and
   what proposers asked for come back in one ``tolist``. Device timings are read after it.
5. Write the accepted tokens into each row's sequence and advance the counts, on the device
   (a call of one row writes by slices, from the counts just read).
6. Emit: each row takes its tokens, stopping exactly where ``generate`` would (``emit.py``).
7. Account: proposers update (caches rolled back, indices extended); counters, statistics,
   costs and ``policy.update`` follow from one function shared with replay
   (``accounting.py``).
8. Keep: the target's cache drops rejected slots, finished rows leave the batch, and masked
   slots are repacked when they pile up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from autospec.engine.accounting import RowStep, StepTimes, account
from autospec.engine.decide import Decision, RowView, decide, make_context
from autospec.engine.emit import criteria_hits, emit, settle
from autospec.engine.proposers import Block
from autospec.engine.sampling import invalid_probs, logits_to_probs, raise_invalid_probs
from autospec.engine.verify import quantize_beta, rejection_sample

__all__ = ["step", "Iteration"]


@dataclass(slots=True)
class Iteration:
    """What the phases of one iteration share. Proposers read its documented part: ``k``
    (the block width the model drafts), ``decision.served``, ``trace`` (the model's block,
    per row, host values), ``accepted`` and ``p`` (device), ``model_rows``, ``time`` and
    ``spend``."""

    ctx: Any  # the policy's Context
    decision: Decision
    marks: list[tuple] = field(default_factory=list)  # (what, count, start, end) on the clock
    lookup_s: dict[str, float] = field(default_factory=dict)  # host time per lookup proposer
    overlay: torch.Tensor | None = None  # [B] rows a lookup proposer served (bool)
    block: Block | None = None  # the combined block
    k: int = 0  # its width: the tokens per row the target scores beyond the one it always does
    lengths: list[int] = field(default_factory=list)  # each row's block length (host)
    raw: torch.Tensor | None = None  # the target's logits [B, k+1, V]
    scores: torch.Tensor | None = None  # processed [B, k+1, V]
    hidden: torch.Tensor | None = None  # the target's last hidden state [B, k+1, d], if asked
    accepted: torch.Tensor | None = None  # [B] on the device
    # each row's emitted tokens on the device: ``tokens``' first ``accepted`` then ``nxt`` [B]
    # (the recovered or bonus token); nxt None (greedy): ``tokens`` [B, k+1] is the target's
    # argmax, whose column ``accepted`` is the next token
    tokens: torch.Tensor | None = None
    nxt: torch.Tensor | None = None
    p: torch.Tensor | None = None  # sampling: the target's probabilities [B, k+1, V]
    trace_dev: torch.Tensor | None = None  # [B, k] the block's acceptance-trace values
    timing: tuple = ()  # the target forward's clock marks and cached tokens
    trace: list[list[int]] = field(default_factory=list)  # per row: the trace values (host)
    taken: list[int] = field(default_factory=list)  # per row: its accepted count (host)
    ended: bool = False  # a row finished

    def model_rows(self) -> torch.Tensor | None:
        """[B] bool: the rows the model proposer served, where a lookup overlaid others;
        None: it served every row there is (no overlay)."""
        return None if self.overlay is None else ~self.overlay

    def spend(self, proposer: str, seconds: float) -> None:
        """Host seconds a lookup proposer spent on this iteration."""
        self.lookup_s[proposer] = self.lookup_s.get(proposer, 0.0) + seconds

    def time(self, what: str, count: int, start, end) -> None:
        """A model proposer's clock marks: its "catch_up" over ``count`` tokens, or its
        "draft" of ``count`` proposals."""
        self.marks.append((what, count, start, end))


def step(batch) -> None:
    it = _decide(batch)  # 1.
    it.block, it.lengths = _propose(batch, it)  # 2.
    if batch.processors is not None and any(n in it.decision.served for n, _ in batch.lookups):
        _cut(batch, it)  # a lookup's proposals end where the processors forbid one
    it.k = it.block.tokens.shape[1]
    _verify(batch, it)  # 3.
    steps, times = _sync(batch, it)  # 4.
    batch.write(it.tokens, it.accepted, it.nxt, it.taken)  # 5.
    _emit(batch, it, steps)  # 6.
    _account(batch, it, steps, times)  # 7.
    _keep(batch, it)  # 8.


def _decide(batch) -> Iteration:
    """The policy's choice for this iteration, resolved per row."""
    rows, model = batch.rows, batch.model
    batch.known = [r.n for r in rows]  # each running row's tokens as the iteration starts
    batch.reserve(max(batch.known) + batch.k_max + 2)  # its block and next token fit
    # what each lookup shows per row (its match now, what its draft holds), the model's gap
    matches = {name: tuple(p.matches()) for name, p in batch.lookups}
    sizes = {name: tuple(p.sizes()) for name, p in batch.lookups}
    gaps = batch.proposers[model].gaps() if model is not None else None
    views = [RowView(r.category, r.live, r.request, r.n - r.L, r.limit - r.n + r.L,
                     gap=gaps[b] if gaps else 0, forecast=r.forecast)
             for b, r in enumerate(rows)]
    why = [] if batch.iteration >= batch.why_at else None
    ctx = make_context(views, k_max=batch.k_max, proposers=batch.proposer_names, model=model,
                       whole=batch.whole, costs=batch.view, why=why, matches=matches,
                       sizes=sizes)
    decision = decide(batch.policy, ctx, longest=max(batch.known),
                      target_context=batch.target_context, draft_context=batch.draft_context)
    if why:
        batch.keep_why(why[-1])
    return Iteration(ctx, decision)


def _verify(batch, it: Iteration) -> None:
    """One target forward over every row's catch-up and block, then the rejection rule."""
    block, k, clock = it.block, it.k, batch.clock
    t0 = clock.mark()
    cached = batch.target_slots.lens[0]
    batch.target_slots.mark()
    it.raw = batch.target_slots.feed(batch.tokens, batch.known, batch.counts, block.tokens,
                                     k + 1, hidden=batch.wants_hidden)
    if batch.wants_hidden:
        it.raw, it.hidden = it.raw
    batch.track_memory()
    it.scores = s_t = batch.process(it.raw, 0, batch.seen, block.tokens)  # [B, k+1, V]
    live_cols = (None if block.lengths is None
                 else torch.arange(k, device=batch.device) < block.lengths[:, None])
    # the acceptance trace is the model proposer's (``it.trace``): built where it served rows
    traced = it.decision.runs(batch.model)
    if batch.greedy:  # the rule with one-hot p and q (``verify.greedy_verify``)
        # the accepted tokens are the target's: every row emits a prefix of its argmax
        it.tokens = tgt = s_t.argmax(dim=-1)  # [B, k+1]
        if not k:  # a plain step: the target's token
            it.accepted = torch.zeros(len(batch.rows), dtype=torch.long, device=batch.device)
        else:
            match = block.tokens == tgt[:, :k]  # [B, k]
            if traced:  # bool: the sync's concatenation reads it as 0 / 1
                it.trace_dev = match
            if live_cols is not None:
                match = match * live_cols
            it.accepted = match.cumprod(dim=-1).sum(dim=-1)  # a short block's end stops it
    else:
        it.tokens = block.tokens
        it.p = p = logits_to_probs(s_t, batch.sampling)  # [B, k+1, V]
        q = _q(block, live_cols, batch.vocab, it.overlay) if k else p[:, :0]
        it.accepted, it.nxt = rejection_sample(p, q, block.tokens, generator=batch.generator,
                                               lengths=block.lengths)
        if traced:
            it.trace_dev = quantize_beta(torch.minimum(p[:, :k], q).sum(-1))  # [B, k]
    it.timing = (t0, clock.mark(), cached)


def _sync(batch, it: Iteration) -> tuple[list[RowStep], StepTimes]:
    """The iteration's one read to the host (with multinomial's validity check, which
    ``sample`` leaves out, and a device prompt on the first iteration)."""
    B, k, block = len(batch.rows), it.k, it.block
    asked = [(p_, p_.sync_parts()) for p_ in batch.proposers.values()]
    # each row's accepted count, then (sampling) its next token, then ``it.tokens``' rows
    parts = [it.accepted] if it.nxt is None else [it.accepted, it.nxt]
    w = it.tokens.shape[1]
    if w:
        parts.append(it.tokens.reshape(-1))
    traced = k and it.trace_dev is not None  # B * k trace values after the tokens
    if traced:
        parts.append(it.trace_dev.reshape(-1))
    for _p, theirs in asked:
        parts += theirs
    if batch.pending is not None:
        parts.append(batch.pending)
    if not batch.greedy:
        parts.append(invalid_probs(it.p, block.q))
    vals = torch.cat(parts).tolist()
    if not batch.greedy and vals.pop():
        raise_invalid_probs(it.p, block.q, min(batch.gens()))
    if batch.pending is not None:
        size = batch.pending.numel()
        batch.receive_prompts(vals[len(vals) - size :])
        del vals[len(vals) - size :]
    props = B if it.nxt is None else 2 * B  # where ``it.tokens`` start
    off = props + B * w + (B * k if traced else 0)
    for p_, theirs in asked:
        if theirs:
            size = sum(t.numel() for t in theirs)
            p_.read(vals[off : off + size])
            off += size
    who, lengths = it.decision.rows, it.lengths
    steps, it.trace, it.taken = [], [], vals[:B]
    trace = props + B * w
    for b, r in enumerate(batch.rows):
        a = vals[b]
        if traced:
            it.trace.append(vals[trace : trace + k])
        new = (vals[props : props + a + 1] if it.nxt is None
               else vals[props : props + a] + [vals[B + b]])
        steps.append(RowStep(proposer=who[b] if lengths[b] else None, proposed=lengths[b],
                             accepted=a, gen=r.n - r.L, new=new))
        props += w
        trace += k
    return steps, _times(batch, it)


def _emit(batch, it: Iteration, steps: list[RowStep]) -> None:
    """Each row takes its tokens, stopping where generate would."""
    rows, eos = batch.rows, batch.eos_set
    hits = (None if batch.criteria is None else
            criteria_hits(batch.criteria, rows, [s.new for s in steps], eos, batch.tokens,
                          it.scores))
    for b, (r, s) in enumerate(zip(rows, steps)):
        s.emitted = emit(r, s.new, hits[b] if hits else (), eos, bool(eos))
        if r.finished:
            it.ended = True
        if r.scores is not None:
            r.scores.extend(it.scores[b, j].clone() for j in range(s.emitted))
        if r.logits is not None:
            r.logits.extend(it.raw[b, j].float().clone() for j in range(s.emitted))
        if batch.streamer is not None:
            batch.streamer.put(torch.tensor(s.new[: s.emitted]))


def _account(batch, it: Iteration, steps: list[RowStep], times: StepTimes) -> None:
    """Proposers learn what was emitted (and add to the rows' accounting); then the shared
    accounting."""
    for proposer in batch.proposers.values():
        proposer.accept(it, steps)
    account(batch.policy, it.ctx, it.k, steps, times, lives=batch.lives,
            requests=batch.requests, stats=batch.row_stats, costs=batch.view)
    batch.iteration += 1


def _keep(batch, it: Iteration) -> None:
    """The target's cache drops rejected slots; finished rows leave; holes are repacked."""
    k = it.k
    batch.target_slots.reject([k - a for a in it.taken], lambda: k - it.accepted)
    if batch.criteria is not None and not batch.eos_set:
        settle(batch.all_rows, batch.limit_dev)
        it.ended = True  # settling may finish rows
    if it.ended:
        batch.leave()
    if batch.counts is not None and batch.rows:  # one row's caches are cropped, never holed
        for cache in batch.slot_caches():
            cache.compact()


def _propose(batch, it: Iteration) -> tuple[Block, list[int]]:
    """Every assigned proposer's block, combined: lookups overlay their rows on the model's
    block. Returns the block and each row's length as the host knows it."""
    d = it.decision
    B, dev = len(d.rows), batch.device
    blocks = []
    for name, rows in d.served.items():
        blocks.append(batch.proposers[name].propose(it, rows, list(d.lengths)))
    if not blocks:  # a plain step
        empty = torch.empty(B, 0, dtype=torch.long, device=dev)
        return Block(tokens=empty, q=None, lengths=None), [0] * B
    if len(blocks) == 1:  # one proposer served every row it was given
        block = blocks[0]
        width = block.tokens.shape[1]
        lengths = block.host_lengths or [width] * B
        if block.lengths is not None and lengths.count(width) == B:
            block.lengths = None
        return block, lengths
    blocks.sort(key=lambda b_: not b_.covers_all)  # a model's block first, lookups on top
    base = blocks[0]
    lengths = list(base.host_lengths or [base.tokens.shape[1]] * B)
    width = max(b_.tokens.shape[1] for b_ in blocks)
    tokens, q, lens_dev = _pad(base.tokens, width), base.q, base.lengths
    for top in blocks[1:]:
        served = top.lengths > 0  # [B]
        it.overlay = served if it.overlay is None else it.overlay | served
        tokens = torch.where(served[:, None], _pad(top.tokens, width), tokens)
        base_len = (lens_dev if lens_dev is not None
                    else torch.full((B,), width, dtype=torch.long, device=dev))
        lens_dev = torch.where(served, top.lengths, base_len)
        for b, n in enumerate(top.host_lengths):
            if n:
                lengths[b] = n
    if lens_dev is not None and all(n == width for n in lengths):
        lens_dev = None
    return Block(tokens=tokens, q=q, lengths=lens_dev, covers_all=base.covers_all), lengths


def _cut(batch, it: Iteration) -> None:
    """Under logits processors, each lookup-served row's block ends at its first token the
    processors forbid (score −inf) after the tokens before it: verification would reject it
    there, and the positions after it would be scored for nothing. A model's proposals are
    drawn from processed scores already. Exact either way: a lookup's block is a proposal."""
    from autospec.engine.processors import forbidden_at

    d, block = it.decision, it.block
    lookups = {n for n, _ in batch.lookups}
    cuts = {}
    for b, r in enumerate(batch.rows):
        m = it.lengths[b]
        if m and d.rows[b] in lookups:
            j = forbidden_at(batch.processors[r.index], batch.row_prefix(b), block.tokens[b, :m],
                             batch.vocab)
            if j < m:
                cuts[b] = j
    if not cuts:
        return
    for b, j in cuts.items():
        it.lengths[b] = j
    width = block.tokens.shape[1]
    if batch.model not in d.served:  # lookups alone: the block narrows to its longest row
        width = max(it.lengths)
        block.tokens = block.tokens[:, :width]
    block.lengths = (None if all(n == width for n in it.lengths)
                     else torch.tensor(it.lengths, dtype=torch.long, device=batch.device))
    block.host_lengths = list(it.lengths)


def _pad(tokens: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - tokens.shape[1]
    return tokens if extra <= 0 else torch.nn.functional.pad(tokens, (0, extra))


def _q(block: Block, live_cols: torch.Tensor | None, vocab: int,
       overlay: torch.Tensor | None) -> torch.Tensor:
    """The distribution each proposal was drawn from, [B, k, V]: the model's q, one-hot at a
    lookup's proposals; zero past a row's block (the next token then comes from p itself)."""
    q = block.q
    if q is None or overlay is not None:
        B, k = block.tokens.shape
        one_hot = torch.zeros(B, k, vocab, device=block.tokens.device)
        one_hot.scatter_(-1, block.tokens[..., None], 1.0)
        q = one_hot if q is None else torch.where(overlay[:, None, None], one_hot, q)
    if live_cols is not None:
        q = q * live_cols[..., None]
    return q


def _times(batch, it: Iteration) -> StepTimes:
    """The iteration's timings, read after the sync (CUDA events have completed)."""
    clock = batch.clock
    t0, t1, cached = it.timing
    draft_s, draft_tokens, catch_up = 0.0, 0, None
    for what, count, a, b in it.marks:
        sec = clock.seconds(a, b)
        if what == "catch_up":
            catch_up = (count, sec)
        elif what == "draft" and count:
            draft_s, draft_tokens = sec, count
    target_s = clock.seconds(t0, t1)
    if clock.cuda:
        clock.recycle(t0, t1, *(m for mark in it.marks for m in mark[2:4]))
    return StepTimes(batch=len(batch.rows), call_batch=batch.call_batch, target_s=target_s,
                     target_cached=cached, prefill=batch.iteration == 0,
                     model=batch.model, draft_s=draft_s,
                     draft_tokens=draft_tokens, catch_up=catch_up, lookup_s=it.lookup_s)
