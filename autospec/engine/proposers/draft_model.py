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
from autospec.policies.stopping import confident
from autospec.traces import (
    TRACE_CATCH_UP_MAX,
    TRACE_GREEDY,
    UNOBSERVED,
    Trace,
    evidence,
    trace_length_problem,
)

from . import Block, EngineSetting, Proposer

__all__ = ["DraftModel", "DraftInput", "DraftReplay", "replay_block"]


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


class DraftModel(Proposer):
    name = "draft"
    kind = "model"
    needs = ("draft_model",)
    code = 0
    title = "the draft model"

    def __init__(self, call):
        super().__init__(call)
        batch = self.batch = call
        need = max(r.n for r in batch.rows) + batch.max_new + 1
        self.slots = batch.open_slots(batch.draft, need,
                                      map_ids=_draft_input(batch.target, batch.draft))
        self.caches = (self.slots,)
        self.early_stop = early_stop_of(batch.policy, batch.rows[0].category)
        self.need_top = batch.record or self.early_stop is not None
        self._kept = batch.record  # this iteration's confidences are read at the sync
        self.presence = batch.sampling.uses_presence
        self.traces = {r.index: Trace(batch.greedy, batch.max_new) for r in batch.rows}
        # sampling: p at each row's bonus position [B, V], and whether the row's last block
        # (the draft model's) was accepted whole [B]: the catch-up's β at that position
        self.p_bonus = self.bonus = None
        self._known: list[int] = []
        # per row, where its last block was accepted whole: (its length, the generated
        # position after it), which the next catch-up predicts (depth evidence)
        self._whole: list[tuple[int, int] | None] = [None] * len(batch.rows)
        # per row index, whether it drafted the row's last iteration (None: none yet)
        self._drafted: dict[int, bool] = {}
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
        rule = it.decision.stop
        # the draft's confidences, read at the sync: stored, or evidence for the stop rule
        self._kept = batch.record or rule is not None
        toks, q, conf, stop_at = self._draft(raw, k, rule)
        k = len(toks)
        proposals = k - 1 if width > 2 else k  # the catch-up forward made the first
        it.time("draft", proposals, first, batch.clock.mark())
        self._k = k
        if self._kept:
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
        it.time("catch_up", len(lens) * width, start, first)
        return raw[:, -1:], first, width

    def _draft(self, raw, k: int, rule=None):
        """Proposals 1 … k from the first one's logits: (the tokens, each [B]; q [B, k, V]
        when sampling; the draft's top probabilities when kept; where each row stopped — by
        the tuned threshold, or by ``rule``, the policy's ``StopRule``)."""
        batch = self.batch
        B, n = raw.shape[0], batch.known
        toks, q_list, conf, stop_at = [], [], [], [k] * B
        need_top, stopping = self.need_top or rule is not None, (
            self.early_stop is not None or rule is not None)
        odds = [1.0] * B  # per row: the block so far accepted, by the rule's calibration
        seen = batch.seen.clone() if batch.seen is not None else None
        for i in range(k):
            if i:
                raw = self.slots.feed(batch.tokens, n, batch.counts, toks[-1][:, None], 1,
                                      offset=i - 1)
            s = batch.process(raw, i, seen, before=toks)[:, 0]  # [B, V]
            top = None
            if batch.greedy:
                tok = s.argmax(dim=-1)  # [B]
                if need_top:
                    top = s.softmax(dim=-1).max(dim=-1).values
            else:
                q = logits_to_probs(s, batch.sampling)  # [B, V]
                q_list.append(q)
                tok = sample(q, batch.generator)
                if need_top:
                    top = q.max(dim=-1).values
            if self._kept:
                conf.append(top)
            toks.append(tok)
            if seen is not None:
                seen.scatter_(1, tok[:, None], True)
            if stopping and i + 1 < k:
                quant = quantize_beta(top).tolist()  # a host read per draft token
                for b, c in enumerate(quant):
                    if stop_at[b] != k:
                        continue
                    if self.early_stop is not None and stops_drafting(c, self.early_stop):
                        stop_at[b] = i + 1
                    elif rule is not None:
                        odds[b] = rule.step(i, odds[b], c)
                        if rule.stops(i, odds[b]):
                            stop_at[b] = i + 1
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
        probs = s.softmax(dim=-1) if batch.record or not batch.greedy else None
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
        if batch.record:
            self._parts.insert(1, quantize_beta(probs.amax(dim=-1)).reshape(-1))
        self._cu_width = w

    def sync_parts(self) -> list[torch.Tensor]:
        return self._parts

    def read(self, values: list[int]) -> None:
        self._values = values

    # -- after the sync ----------------------------------------------------------------------
    def accept(self, it, steps) -> None:
        """Traces, what the catch-up saw (evidence of its acceptance: positions it had not
        drafted, at depth 0; the one after a block it had accepted whole, at its length), and
        the cache rolled back to what was accepted."""
        batch, k, vals, name = self.batch, self._k, self._values, self.name
        B = len(batch.rows)
        ran = it.decision.runs(name)
        off = 0
        known = max(self._known, default=0) if ran else 0
        if known:
            w = self._cu_width
            cu = [vals[off + b * w : off + (b + 1) * w] for b in range(B)]
            off += B * w
            cu_conf = [()] * B
            if batch.record:
                cu_conf = [vals[off + b * w : off + (b + 1) * w] for b in range(B)]
                off += B * w
            for b, (r, step) in enumerate(zip(batch.rows, steps)):
                kn = self._known[b]
                if not kn:
                    continue
                v, c = cu[b][w - kn :], cu_conf[b][w - kn :]
                self.traces[r.index].put(step.gen - kn, v, c)
                found = []
                if self._drafted.get(r.index) is False:  # the positions were not its own
                    found += [(0, evidence(x, batch.greedy)) for x in v if x != UNOBSERVED]
                whole = self._whole[b]
                if whole is not None and 0 <= whole[1] - (step.gen - kn) < kn:
                    x = v[whole[1] - (step.gen - kn)]
                    if x != UNOBSERVED:
                        found.append((whole[0], evidence(x, batch.greedy)))
                if found:
                    step.evidence[name] = found
        for r, step in zip(batch.rows, steps):
            self._drafted[r.index] = step.proposer == name
        block_conf = [()] * B
        if ran and self._kept:
            block_conf = [vals[off + b * k : off + (b + 1) * k] for b in range(B)]
        if not ran:
            self.p_bonus = self.bonus = None  # the next catch-up does not start at a bonus
            return
        for b, (r, step) in enumerate(zip(batch.rows, steps)):
            whole = None
            if step.proposer == name:  # past the first rejection: off the target's prefix
                on_prefix = min(step.accepted + 1, step.proposed)
                self.traces[r.index].put(step.gen, it.trace[b][:on_prefix],
                                         block_conf[b][:on_prefix])
                if block_conf[b]:  # how often a token proposed that confidently is accepted
                    step.confident[name] = confident(it.trace[b][:on_prefix],
                                                     block_conf[b][:on_prefix], batch.greedy)
                if step.accepted == step.proposed == k:
                    whole = (k, step.gen + k)
            self._whole[b] = whole
        mine = it.model_rows()

        def drop_dev():
            kept = it.accepted.clamp(max=k - 1)
            return (k - 1) - (kept if mine is None else torch.where(mine, kept, 0))

        # it keeps the proposals it took in (all but its last) that its own rows accepted
        self.slots.reject([k - 1 - min(s.accepted, k - 1) if s.proposer == name else k - 1
                           for s in steps], drop_dev)
        self.p_bonus = self.bonus = None
        if not batch.greedy and any(s.proposer == name and s.accepted == k for s in steps):
            whole = it.accepted == k
            self.bonus = whole if mine is None else whole & mine
            self.p_bonus = it.p[:, k]

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        self._whole = [self._whole[b] for b in keep]
        if self.p_bonus is not None:
            self.p_bonus, self.bonus = self.p_bonus[index], self.bonus[index]

    def finish(self, row, stats) -> None:
        trace = self.traces[row.index]
        stats.traces[self.name] = trace.finish(stats.new_tokens)
        if self.batch.record:
            stats.extras[self.name] = {"confidence": trace.finish_confidence(stats.new_tokens)}

    def release(self) -> None:
        self.slots.release()

    @classmethod
    def trace_problem(cls, trace: bytes, positions: int) -> str | None:
        """Its acceptance trace: one byte per generated position (what replay reads at g)."""
        return trace_length_problem(trace, positions, width=1)

    @classmethod
    def replay(cls, record) -> DraftReplay | None:
        trace = (getattr(record, "traces", None) or {}).get(cls.name)
        if not trace:  # none recorded: the request replays without it, as without a row
            return None
        extras = (getattr(record, "extras", None) or {}).get(cls.name) or {}
        return DraftReplay(record.trace_kind, trace, extras.get("confidence"),
                           int(getattr(record, "prompt_tokens", 0) or 0))

    @classmethod
    def export(cls, engine: str, plan) -> EngineSetting:
        """vLLM's ``draft_model`` method with a per-batch-size schedule
        (``num_speculative_tokens_per_batch_size``, first range from 1); TensorRT-LLM's
        ``Draft_Target`` with ``draft_len_schedule`` (no value above ``max_draft_len``, the
        first); SGLang's STANDALONE (a chain: top-k 1, k + 1 draft tokens with the verified
        one); llama.cpp's ``-md`` with ``--spec-draft-n-max`` (and the tuned early stop)."""
        ranges = plan.ranges()
        if engine == "vllm":
            k_max = max(k for *_, k in ranges)
            if k_max == 0:
                return EngineSetting()
            cfg = {"model": plan.draft, "method": "draft_model", "num_speculative_tokens": k_max}
            if len(ranges) > 1:
                cfg["num_speculative_tokens_per_batch_size"] = [list(r) for r in ranges]
            return EngineSetting(cfg)
        if engine == "trtllm":
            k_first = ranges[0][2]
            if k_first == 0:
                return EngineSetting()
            schedule = {}
            for _, end, k in ranges:
                schedule[end] = min(k, k_first)  # none may exceed max_draft_len (the first)
            # trailing k = 0 ranges are implicit (above the last key speculation is off)
            while len(schedule) > 1 and schedule[max(schedule)] == 0:
                del schedule[max(schedule)]
            cfg = {"decoding_type": "Draft_Target", "speculative_model": plan.draft,
                   "max_draft_len": k_first}
            if len(ranges) > 1 or plan.max_batch > 1:
                cfg["draft_len_schedule"] = schedule
            return EngineSetting(cfg)
        k = plan.k
        if k <= 0:
            return EngineSetting()
        if engine == "sglang":
            return EngineSetting(flags=[
                "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                plan.draft, "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(k + 1)])
        flags = ["-md", plan.draft, "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
        if plan.early_stop is not None:
            flags += ["--spec-draft-p-min", f"{plan.early_stop:g}"]
        return EngineSetting(flags=flags)


def replay_block(kind: str, trace, g: int, k: int, *, confidence=None,
                 early_stop: float | None = None, rule=None, rng=None
                 ) -> tuple[int, int, bool]:
    """One block of k drafted from generated position g, replayed from the draft model's
    acceptance trace: (drafted, accepted, whether it ran into an unobserved position, counted
    as a rejection there).

    Greedy traces replay exactly. Sampled ones draw each acceptance from its recorded β with
    ``rng``. With ``early_stop`` and the request's ``confidence`` bytes, drafting stops where
    the live loop's rule (``policies.base.stops_drafting``) would: token i's confidence is
    recorded when tokens 0…i−1 were accepted (the draft ran on the target's prefix). Past the
    first rejection the live draft runs off that prefix, where nothing was recorded: replay
    assumes it drafts on, which can only overcount draft cost, never the accepted count.
    With ``rule`` (the policy's ``StopRule``) drafting stops where the rule's
    ``StopRule.stops`` would live; past the first rejection, likewise, the confidences are
    the prefix's last (replay cannot know the live draft's there)."""
    m, rejected, unobserved = 0, False, False
    odds, last = 1.0, UNOBSERVED
    for i in range(k):
        c = UNOBSERVED
        if not rejected:
            # past the trace's end (a request logged with fewer positions): nothing observed
            v = trace[g + i] if g + i < len(trace) else UNOBSERVED
            if v == UNOBSERVED:
                unobserved = rejected = True
            elif v == 1 if kind == TRACE_GREEDY else _draw(rng) < v / 254:
                m += 1
            else:
                rejected = True
            if confidence is not None and g + i < len(confidence):
                c = last = confidence[g + i]
        if early_stop is not None and i + 1 < k and stops_drafting(c, early_stop):
            return i + 1, m, unobserved
        if rule is not None and i + 1 < k:
            odds = rule.step(i, odds, c if not rejected or c != UNOBSERVED else last)
            if rule.stops(i, odds):
                return i + 1, m, unobserved
    return k, m, unobserved


def _draw(rng) -> float:
    if rng is None:
        raise ValueError("replaying a sampled trace draws acceptances: pass rng")
    return rng.random()


class DraftReplay:
    """The draft model over one logged request, replayed (``Proposer.replay``): its blocks
    from the acceptance trace (``replay_block``), and its cache as the live loop keeps it —
    the prompt to take in before its first block, the tokens others emitted since its last
    (``gap``), what its next catch-up predicts and learns from (``catch_up``)."""

    def __init__(self, kind: str, trace, confidence, prompt_tokens: int):
        self.kind, self.trace, self.conf = kind, trace, confidence
        self.covered = 0  # first position the draft has not predicted
        self.prev_k: int | None = None  # its last block for this row (0: it did not draft)
        # its last block, accepted whole: (length, the position after it), which the next
        # catch-up predicts (depth evidence)
        self.whole: tuple[int, int] | None = None
        self.gap = prompt_tokens  # what it has not taken in: the prompt, at first

    def now(self, g: int) -> tuple[int, int]:
        return 0, 0

    def block(self, g: int, k: int, *, stop: float | None = None, rule=None, rng=None
              ) -> tuple[int, int, bool]:
        return replay_block(self.kind, self.trace, g, k, confidence=self.conf,
                            early_stop=stop, rule=rule, rng=rng)

    def confident(self, g: int, on_prefix: int) -> list[tuple[int, float]]:
        """(confidence, acceptance) of its block's first ``on_prefix`` tokens from g, where
        the record holds its confidences (``policies.stopping.confident``)."""
        if self.conf is None or on_prefix <= 0:
            return []
        end = g + on_prefix
        return confident(self.trace[g:end], self.conf[g:end], self.kind == TRACE_GREEDY)

    def shadow(self, g: int, emitted: int) -> None:
        return None

    def catch_up(self, g: int) -> list[tuple[int, float]]:
        """It drafts at g: its first forward takes in what it has not seen, predicting those
        positions from the target's prefix. Where it had not drafted them they are evidence
        at depth 0; where its last block was accepted whole, the position after it is
        evidence at that block's length; either way they are covered and its gap closed."""
        found: list[tuple[int, float]] = []
        start = max(self.covered, g - TRACE_CATCH_UP_MAX)
        greedy = self.kind == TRACE_GREEDY
        if self.prev_k == 0:
            found += [(0, evidence(v, greedy)) for v in self.trace[start:g] if v != UNOBSERVED]
        if self.whole is not None and start <= self.whole[1] < g:
            v = self.trace[self.whole[1]]
            if v != UNOBSERVED:
                found.append((self.whole[0], evidence(v, greedy)))
        self.whole = None
        self.covered = max(self.covered, g)
        self.gap = 0
        return found

    def after(self, g: int, who, proposed: int, accepted: int, width: int) -> None:
        """After its own block it keeps what its row accepted (the target's token is new to
        it, and its last proposal where it accepted every one it was fed: of ``width`` it
        drafted for the batch it took in all but the last); after another's, or a plain
        step, what was emitted is its gap."""
        if who == DraftModel.name and proposed > 0:
            self.covered = g + min(accepted + 1, proposed)
            self.prev_k = proposed
            self.gap = accepted + 1 - min(accepted, width - 1)
            if accepted == width:
                self.whole = (width, g + accepted)
        else:
            self.gap += accepted + 1
            self.prev_k = 0
