"""The draft model as a proposer: k tokens per row, drawn autoregressively from its own cache.

Its cache lags the target's: whatever it has not taken in (the prompt at first, the tokens
emitted by k = 0 steps or by another proposer since) is fed at its next block's first forward,
its *catch-up*. The catch-up's predictions of tokens already emitted are acceptance-trace
material (``autospec.traces``): the draft predicted them from the target's own prefix.

After verification it keeps, per row, the proposals it took in that were accepted (at most
k − 1: its last proposal is never fed); the target's next token is new to it, and when all k
were accepted so is its last proposal, so its next catch-up is 1 or 2 tokens (a 2-token
forward costs about what a 1-token one does).

Draft-side early stopping (``EarlyStop``): a row stops drafting once the draft's probability
of its own last token falls below the threshold; its block is then shorter (exact: the choice
depends only on the draft's distribution). Drafting stops when every row has stopped. It costs
a host read per draft token.
"""

from __future__ import annotations

import torch

from autospec.engine.sampling import logits_to_probs, sample
from autospec.engine.verify import quantize_beta
from autospec.policies.base import early_stop_of, stops_drafting
from autospec.traces import TRACE_CATCH_UP_MAX, UNOBSERVED, Trace, evidence

from . import Block

__all__ = ["DraftModel", "DraftInput"]


class DraftInput:
    """Ids the draft can embed. A target with more embedding rows than the draft (padded
    vocabularies: Qwen2.5-7B has 152064 rows, its 0.5B draft 151936) can emit, or be prompted
    with, ids the draft has no row for. The draft reads each such id as ``placeholder`` (its
    pad id, else 0): that changes only what the draft proposes, never the output, because the
    draft's q is still the distribution its proposals are drawn from, which is all the
    rejection rule needs. One device-side ``masked_fill``, only when the draft has fewer rows."""

    def __init__(self, target, draft):
        self.rows = _embedding_rows(draft)
        self.active = self.rows < _embedding_rows(target)
        pad = getattr(getattr(draft, "generation_config", None), "pad_token_id", None)
        if pad is None:
            pad = getattr(draft.config, "pad_token_id", None)
        self.placeholder = pad if isinstance(pad, int) and 0 <= pad < self.rows else 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return ids
        return ids.masked_fill(ids >= self.rows, self.placeholder)


def _draft_input(target, draft):
    """``DraftInput`` where the draft has fewer embedding rows, else None (ids as they are)."""
    mapping = DraftInput(target, draft)
    return mapping if mapping.active else None


def _embedding_rows(model) -> int:
    return model.get_input_embeddings().weight.shape[0]


class DraftModel:
    name = "draft"

    def __init__(self, batch):
        self.batch = batch
        need = max(r.n for r in batch.rows) + batch.max_new + 1
        self.slots = batch.open_slots(batch.draft, need,
                                      map_ids=_draft_input(batch.target, batch.draft))
        self.caches = (self.slots,)
        self.early_stop = early_stop_of(batch.policy, batch.rows[0].category)
        self.need_top = batch.record_conf or self.early_stop is not None
        self.presence = batch.sampling.uses_presence
        self.traces = {r.index: Trace(batch.greedy, batch.max_new) for r in batch.rows}
        # sampling: p at each row's bonus position [B, V], and whether the row's last block
        # (the draft model's) was accepted whole [B]: the catch-up's β at that position
        self.p_bonus = self.bonus = None
        self._known: list[int] = []
        # per row, where its last block was accepted whole: (its length, the generated
        # position after it), which the next catch-up predicts (``RowStep.beyond``)
        self._whole: list[tuple[int, int] | None] = [None] * len(batch.rows)
        self._parts: list[torch.Tensor] = []
        self._values: list[int] = []
        self._k = 0

    def gaps(self) -> list[int]:
        """Tokens each row's draft cache has not taken in (the policy prices catching up)."""
        return [r.n - c for r, c in zip(self.batch.rows, self.slots.lens)]

    # -- proposing ---------------------------------------------------------------------------
    def propose(self, it, rows: list[int], lengths: list[int]) -> Block:
        """k tokens for every row (rows another proposer serves are drafted too, and their
        drafts dropped: the caches stay in step)."""
        batch, k = self.batch, it.decision.k
        self._parts, self._values = [], []
        self.slots.mark()
        raw, first, width = self._catch_up(it)
        toks, q, conf, stop_at = self._draft(raw, k)
        k = len(toks)
        proposals = k - 1 if width > 2 else k  # the catch-up forward made the first
        it.marks.append(("draft", proposals, first, batch.clock.mark()))
        self._k = k
        if batch.record_conf:
            self._parts.append(quantize_beta(torch.stack(conf, dim=1)).reshape(-1))
        # each row's block: no longer than it can keep (``decide``), nor than early stopping
        # let it draft
        host = [min(s_, k, r.limit - r.n + r.L - 1) for s_, r in zip(stop_at, batch.rows)]
        lengths_dev = None
        if min(host) < k:
            lengths_dev = batch.room(k)
            if min(stop_at) < k:  # early stopping reads to the host anyway
                lengths_dev = torch.minimum(lengths_dev,
                                            torch.tensor(stop_at, device=batch.device))
        return Block(tokens=torch.stack(toks, dim=1), q=q, lengths=lengths_dev,
                     covers_all=True, host_lengths=host)

    def _catch_up(self, it):
        """The block's first forward: what the draft has not taken in, then its first
        proposal's logits. Returns (those logits [B, 1, V], the clock mark the proposals'
        time starts from, the widest catch-up)."""
        batch, clock = self.batch, self.batch.clock
        lens = self.slots.lens
        # catch-up rows whose predictions are generated tokens already known: trace material
        # (with a repetition penalty their processing would need past seen-sets: skipped)
        self._known, width, known = [], 0, 0
        presence = self.presence
        for r, c in zip(batch.rows, lens):
            kn = 0 if presence else min(max(0, r.n - max(r.L, c + 1)), TRACE_CATCH_UP_MAX)
            self._known.append(kn)
            known, width = max(known, kn), max(width, r.n - c)
        start = clock.mark()
        raw = self.slots.feed(batch.tokens, batch.known, batch.counts, None, known + 1)
        if known:
            self._catch_up_trace(raw[:, :known], it)
        if width <= 2:
            return raw[:, -1:], start, width
        # the prompt, or a stretch it did not draft: a cost of resuming, not T_d
        first = clock.mark()
        it.marks.append(("catch_up", len(lens) * width, start, first))
        return raw[:, -1:], first, width

    def _draft(self, raw, k: int):
        """Proposals 1 … k from the first one's logits: (the tokens, each [B]; q [B, k, V]
        when sampling; the draft's top probabilities when kept; where each row stopped)."""
        batch = self.batch
        B, n = raw.shape[0], batch.known
        toks, q_list, conf, stop_at = [], [], [], [k] * B
        seen = batch.seen.clone() if batch.seen is not None else None
        for i in range(k):
            if i:
                raw = self.slots.feed(batch.tokens, n, batch.counts, toks[-1][:, None], 1,
                                      offset=i - 1)
            s = batch.process(raw, i, seen)[:, 0]  # [B, V]
            top = None
            if batch.greedy:
                tok = s.argmax(dim=-1)  # [B]
                if self.need_top:
                    top = s.softmax(dim=-1).max(dim=-1).values
            else:
                q = logits_to_probs(s, batch.sampling)  # [B, V]
                q_list.append(q)
                tok = sample(q, batch.generator)
                if self.need_top:
                    top = q.max(dim=-1).values
            if batch.record_conf:
                conf.append(top)
            toks.append(tok)
            if seen is not None:
                seen.scatter_(1, tok[:, None], True)
            if self.early_stop is not None and i + 1 < k:
                quant = quantize_beta(top).tolist()  # a host read per draft token
                stop_at = [i + 1 if s_ == k and stops_drafting(c, self.early_stop) else s_
                           for s_, c in zip(stop_at, quant)]
                if all(s_ <= i + 1 for s_ in stop_at):
                    break
        q = torch.stack(q_list, dim=1) if q_list else None
        if len(toks) < k:  # every row stopped early
            stop_at = [min(s_, len(toks)) for s_ in stop_at]
        return toks, q, conf, stop_at

    def _catch_up_trace(self, raw: torch.Tensor, it) -> None:
        """Trace values (and confidences) of the generated positions the catch-up predicted:
        column j of ``raw`` [B, w, V] predicted the token at position n − w + j."""
        batch = self.batch
        B, w = raw.shape[:2]
        s = batch.process(raw, -w)
        probs = s.softmax(dim=-1) if batch.record_conf or not batch.greedy else None
        if batch.greedy:
            at = batch.n_dev[:, None] - w + torch.arange(w, device=batch.device)
            truth = batch.tokens.gather(1, at.clamp_min(0))
            vals = (s.argmax(dim=-1) == truth).long()
        else:
            vals = torch.full((B, w), UNOBSERVED, dtype=torch.long, device=batch.device)
            if self.p_bonus is not None:  # β where the row's last block was accepted whole
                beta = quantize_beta(torch.minimum(self.p_bonus, probs[:, -1]).sum(-1))
                vals[:, -1] = torch.where(self.bonus, beta, UNOBSERVED)
        self._parts.insert(0, vals.reshape(-1))
        if batch.record_conf:
            self._parts.insert(1, quantize_beta(probs.amax(dim=-1)).reshape(-1))
        self._cu_width = w

    def sync_parts(self) -> list[torch.Tensor]:
        return self._parts

    def read(self, values: list[int]) -> None:
        self._values = values

    # -- after the sync ----------------------------------------------------------------------
    def accept(self, it, steps) -> None:
        """Traces, what the catch-up saw, and the cache rolled back to what was accepted."""
        batch, k, vals = self.batch, self._k, self._values
        B = len(batch.rows)
        ran = self.name in it.decision.served
        off = 0
        known = max(self._known, default=0) if ran else 0
        if known:
            w = self._cu_width
            cu = [vals[off + b * w : off + (b + 1) * w] for b in range(B)]
            off += B * w
            cu_conf = [()] * B
            if batch.record_conf:
                cu_conf = [vals[off + b * w : off + (b + 1) * w] for b in range(B)]
                off += B * w
            for b, (r, step) in enumerate(zip(batch.rows, steps)):
                kn = self._known[b]
                if not kn:
                    continue
                v, c = cu[b][w - kn :], cu_conf[b][w - kn :]
                self.traces[r.index].put(step.gen - kn, v, c)
                whole = self._whole[b]
                if whole is not None and 0 <= whole[1] - (step.gen - kn) < kn:
                    x = v[whole[1] - (step.gen - kn)]
                    if x != UNOBSERVED:
                        step.beyond = (whole[0], evidence(x, batch.greedy))
                st = r.stats  # the positions before were not the draft model's: it learns
                if st.k_schedule and (st.k_schedule[-1] == 0 or st.proposer_schedule[-1]):
                    step.unproposed = tuple(evidence(x, batch.greedy)
                                            for x in v if x != UNOBSERVED)
        block_conf = [()] * B
        if ran and batch.record_conf:
            block_conf = [vals[off + b * k : off + (b + 1) * k] for b in range(B)]
        if not ran:
            self.p_bonus = self.bonus = None  # the next catch-up does not start at a bonus
            return
        for b, (r, step) in enumerate(zip(batch.rows, steps)):
            whole = None
            if step.proposer == self.name:  # past the first rejection: off the target's prefix
                on_prefix = min(step.accepted + 1, step.proposed)
                self.traces[r.index].put(step.gen, it.trace[b][:on_prefix],
                                         block_conf[b][:on_prefix])
                if step.accepted == step.proposed == k:
                    whole = (k, step.gen + k)
            self._whole[b] = whole
        mine = it.rows_of(self.name)

        def drop_dev():
            kept = it.accepted.clamp(max=k - 1)
            return (k - 1) - (kept if mine is None else torch.where(mine, kept, 0))

        # it keeps the proposals it took in (all but its last) that its own rows accepted
        self.slots.reject([k - 1 - min(s.accepted, k - 1) if s.proposer == self.name else k - 1
                           for s in steps], drop_dev)
        self.p_bonus = self.bonus = None
        if not batch.greedy and any(s.proposer == self.name and s.accepted == k for s in steps):
            whole = it.accepted == k
            self.bonus = whole if mine is None else whole & mine
            self.p_bonus = it.p[:, k]

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        self._whole = [self._whole[b] for b in keep]
        if self.p_bonus is not None:
            self.p_bonus, self.bonus = self.p_bonus[index], self.bonus[index]

    def finish(self, row, stats) -> None:
        trace = self.traces[row.index]
        stats.trace = trace.finish(stats.new_tokens)
        if self.batch.record_conf:
            stats.confidence = trace.finish_confidence(stats.new_tokens)

    def release(self) -> None:
        self.slots.release()
