"""The exact draft → verify loop at batch > 1.

One ``generate`` call on B prompts runs as one batch: every iteration drafts k tokens for every
row still running (one k for the batch, chosen by the policy from the batch's cost curve),
scores them in one target forward of B × (k + 1) tokens, and verifies each row on its own.

Ragged acceptance without re-running forwards: both caches are B rows of S *slots*. A slot
holds a token of that row, left padding, or a draft token the row rejected; an attention mask
over the slots ([B, S], 1 = a token of the row's sequence) hides the last two, and every token
is fed with its own position id, so a row's attention sees exactly its sequence, in order,
at the right positions — whatever its neighbours accepted. After verification a row's rejected
slots are masked (never attended again), its accepted ones stay, and the next forward appends
after the longest row. Rows that fed fewer tokens (a row whose draft needs one catch-up token
while another needs two) are right-aligned, padded on the left within the block.

Memory bound: masked slots accumulate at most k per iteration per row. Whenever the slots
exceed the longest row's tokens by more than ``max(SLACK, S // 4)``, each row's valid slots are
gathered to the right (one copy of the cache), so a cache never holds more than
~1.25 × (longest prompt + tokens generated) + SLACK + k + 1 slots per row.
Rows that finish leave the batch at once (their rows are dropped from both caches and every
per-row tensor), and columns no remaining row uses are cut: a long tail costs forwards of the
rows still running, not of B.

Everything else mirrors the batch-1 loop (``loop.py``): logits processed per row as
``generate`` would, the rejection rule of ``verify.py`` per row, acceptance traces per row,
one host sync per iteration. Static caches and CUDA graphs serve batch 1 only; batched requests
run on transformers' DynamicCache. Draft-side early stopping applies at batch 1 only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from autospec.engine.loop import DraftInput, LoopResult, LoopStats, _bump, _criteria_hit, _fit_vocab
from autospec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramIndex, agreement
from autospec.policies.base import Context, Outcome, Policy, proposer_of
from autospec.engine.runners import Forward, new_cache
from autospec.engine.sampling import (
    SamplingConfig,
    block_presence,
    invalid_probs,
    logits_to_probs,
    process_logits,
    raise_invalid_probs,
    sample,
    seen_tokens,
)
from autospec.store.record import TRACE_CATCH_UP_MAX, TRACE_GREEDY, TRACE_SAMPLED, UNOBSERVED
from autospec.telemetry import Clock, Trace, kv_bytes_per_token, quantize_beta

log = logging.getLogger(__name__)

__all__ = ["BatchResult", "speculative_generate_batch", "SLACK"]

SLACK = 32  # masked slots tolerated per row before the cache is repacked


@dataclass
class BatchResult:
    rows: list[LoopResult]  # one per prompt, in input order; sequences [1, L_i + new_i]
    peak_kv_bytes: int  # the largest target + draft KV the batch held at once
    wall_s: float


def speculative_generate_batch(target, draft, prompts: list[torch.Tensor], *,
                               sampling: SamplingConfig, policy: Policy, max_new_tokens: int,
                               categories: list[str], lives: list | None = None,
                               costs=None, **options) -> BatchResult:
    """Generate B prompts (each [1, L_i], padding removed) exactly as ``generate`` would.

    Options as ``loop.speculative_generate``: min_new_tokens, eos_token_ids, stopping_criteria
    (called per row with ``row_prefix[i]`` + the row's tokens, as generate passes its padded
    row), generator, k_max, target_context, draft_context, output_scores, output_logits,
    record_confidence (the draft's top probability per token, for the store; off: not computed),
    ngram (the n-gram proposer's index factory; ``draft`` None: it drafts alone).

    The n-gram proposer at batch: each row proposes from its own history, up to the batch's k
    (fewer, or none, where its match is short or missing: the row's block is shorter, its
    padded slots are never accepted and its next token comes from p at its own end, so the
    rule stays exact per row). "ngram" skips the draft model's forwards; "hybrid" runs them and
    takes, per row, the n-gram's block where its match has ≥ min_match tokens (the draft's
    own proposals for that row are then masked out of its cache, as rejected ones are).
    lives: each row's category LiveStats (fed with each row's acceptance); costs: a
    ``BatchCosts`` fed with the batch's timings by (B, n)."""
    loop = _BatchLoop(target, draft, prompts, sampling, policy, max_new_tokens, categories,
                      lives or [None] * len(prompts), costs, **options)
    with torch.inference_mode():
        while loop.rows:
            loop.step()
    return loop.result()


class _Row:
    """Host-side state of one prompt."""

    def __init__(self, index: int, ids: torch.Tensor, greedy: bool, max_new: int,
                 category: str, live, prefix: torch.Tensor | None, want_scores: bool,
                 want_logits: bool):
        self.index, self.category, self.live = index, category, live
        self.L = self.n = ids.shape[1]
        self.t_len = self.d_len = 0  # tokens of the row each cache holds
        self.t_end = self.d_end = 0  # slot after the row's last valid slot
        self.prefix = prefix  # what generate's row holds before the prompt (left padding)
        self.tokens: list[int] = ids[0].tolist()
        self.stats = LoopStats(prompt_tokens=self.L, started_at=time.time(),
                               trace_kind=TRACE_GREEDY if greedy else TRACE_SAMPLED)
        self.trace = Trace(greedy, max_new)
        self.scores = [] if want_scores else None
        self.logits = [] if want_logits else None
        self.finished = False
        self.limit = max_new  # tokens the row may generate (see _BatchLoop.settle)
        self.stop_at: int | None = None  # without EOS: where a stopping criterion first hit
        self.wall_end = 0.0
        self.bonus = False  # sampling: the row's last block was accepted whole
        self.ngram = None  # the row's n-gram index (set by the loop: its factory)

    @property
    def gen(self) -> int:
        return self.n - self.L


class _BatchLoop:
    def __init__(self, target, draft, prompts, sampling: SamplingConfig, policy: Policy,
                 max_new_tokens: int, categories, lives, costs, *, min_new_tokens: int = 0,
                 eos_token_ids: tuple[int, ...] = (), stopping_criteria=None,
                 generator: torch.Generator | None = None, k_max: int = 16,
                 target_context: int | None = None, draft_context: int | None = None,
                 output_scores: bool = False, output_logits: bool = False,
                 row_prefix: list[torch.Tensor] | None = None, record_confidence: bool = False,
                 ngram=None):
        self.t_start = time.perf_counter()
        self.record_conf = record_confidence
        self.device = device = prompts[0].device
        self.sampling, self.policy, self.generator = sampling, policy, generator
        self.greedy = not sampling.do_sample
        self.max_new, self.min_new = max_new_tokens, min_new_tokens
        self.criteria, self.k_max, self.costs = stopping_criteria, k_max, costs
        self.target_context, self.draft_context = target_context, draft_context
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.has_draft = draft is not None
        # ids the draft lacks (loop.DraftInput)
        self.draft_input = DraftInput(target, draft) if self.has_draft else None
        self.proposers = ("draft", "ngram") if self.has_draft else ("ngram",)
        self.eos = (torch.tensor(eos_token_ids, dtype=torch.long, device=device)
                    if eos_token_ids else None)
        self.eos_set = set(eos_token_ids)
        self.all_rows = [
            _Row(i, p, self.greedy, max_new_tokens, categories[i], lives[i],
                 None if row_prefix is None else row_prefix[i], output_scores, output_logits)
            for i, p in enumerate(prompts)]
        self.rows = list(self.all_rows)  # the rows still running, in batch order
        factory = NgramIndex if ngram is None else ngram
        for r in self.all_rows:  # each row's n-gram index over its own prompt and output
            r.ngram = factory(list(r.tokens))
        B = len(prompts)
        self.seen = None
        if sampling.uses_presence:
            self.seen = torch.zeros(B, self.vocab, dtype=torch.bool, device=device)
            for i, p in enumerate(prompts):
                self.seen[i] = seen_tokens(p, self.vocab)[0]
        self.t_fwd, self.t_cache = Forward(target), new_cache(target)
        self.d_fwd = Forward(draft) if self.has_draft else None
        self.d_cache = new_cache(draft) if self.has_draft else None
        self.t_mask = torch.zeros(B, 0, dtype=torch.long, device=device)
        self.d_mask = torch.zeros(B, 0, dtype=torch.long, device=device)
        self.kv_t = kv_bytes_per_token(target)
        self.kv_d = kv_bytes_per_token(draft) if self.has_draft else 0
        self.peak_kv = 0
        self.clock = Clock(device)
        self.p_bonus = None  # sampling: [B, V] p at each row's last bonus position
        self.iteration = 0
        self.repacks = 0
        self.batch0 = B

    # -- logits processing, per row as generate would -----------------------------------------
    def banned(self, gens: list[int], npos: int) -> torch.Tensor | None:
        """EOS suppressed where a row's generated count is below min_new_tokens: [B, npos, V]."""
        if self.eos is None or min(gens) >= self.min_new:
            return None
        g = torch.tensor(gens, device=self.device)[:, None] + torch.arange(npos, device=self.device)
        mask = torch.zeros(len(gens), npos, self.vocab, dtype=torch.bool, device=self.device)
        mask[:, :, self.eos] = (g < self.min_new)[:, :, None]
        return mask

    def process(self, raw, gens: list[int], seen, block=None) -> torch.Tensor:
        raw = _fit_vocab(raw, self.vocab)
        npos = raw.shape[1]
        pos_seen = None if seen is None else block_presence(seen, block, npos)
        return process_logits(raw, self.sampling, seen=pos_seen, banned=self.banned(gens, npos))

    # -- forwards over slots -------------------------------------------------------------------
    def feed(self, which: str, tokens: list[list[int]] | None, lens: list[int],
             extra: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Append to one model's cache: per row the catch-up ``tokens`` (right-aligned, padded
        on the left within the block) then the columns of ``extra`` [B, e] (drafts), every
        token at its row's next position. Returns logits [B, keep, V]."""
        B = len(self.rows)
        width = max(len(t) for t in tokens) if tokens else 0
        e = 0 if extra is None else extra.shape[1]
        ids = torch.zeros(B, width + e, dtype=torch.long, device=self.device)
        mask = torch.zeros(B, width + e, dtype=torch.long, device=self.device)
        pos = torch.zeros(B, width + e, dtype=torch.long, device=self.device)
        if width:
            rows = [i for i, t in enumerate(tokens) for _ in t]
            cols = [width - len(t) + j for t in tokens for j in range(len(t))]
            vals = [v for t in tokens for v in t]
            ps = [lens[i] + j for i, t in enumerate(tokens) for j in range(len(t))]
            idx = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
            ids[idx] = torch.tensor(vals, device=self.device)
            mask[idx] = 1
            pos[idx] = torch.tensor(ps, device=self.device)
        if e:
            ids[:, width:] = extra
            mask[:, width:] = 1
            base = torch.tensor([lens[i] + len(tokens[i]) if tokens else lens[i]
                                 for i in range(B)], device=self.device)
            pos[:, width:] = base[:, None] + torch.arange(e, device=self.device)
        if which == "t":
            self.t_mask = torch.cat([self.t_mask, mask], dim=1)
            out = self.t_fwd(ids, self.t_cache, keep, attention_mask=self.t_mask,
                             position_ids=pos)
        else:
            self.d_mask = torch.cat([self.d_mask, mask], dim=1)
            out = self.d_fwd(self.draft_input(ids), self.d_cache, keep, attention_mask=self.d_mask,
                             position_ids=pos)
        kv = B * (self.t_mask.shape[1] * self.kv_t + self.d_mask.shape[1] * self.kv_d)
        self.peak_kv = max(self.peak_kv, kv)
        return out

    # -- one iteration -------------------------------------------------------------------------
    def context(self) -> Context:
        rows = self.rows
        lead = rows[0]
        gens = [r.gen for r in rows]
        matches = tuple(r.ngram.match()[0] for r in rows)
        return Context(category=lead.category, k_max=self.k_max, batch_size=len(rows),
                       generated=min(gens), remaining=self.max_new - min(gens), live=lead.live,
                       remaining_rows=tuple(r.limit - r.gen for r in rows),
                       categories=tuple(r.category for r in rows),
                       rows=tuple(r.live for r in rows), costs=self.costs,
                       proposers=self.proposers, ngram_match=max(matches),
                       ngram_matches=matches,
                       draft_gap=(max(r.n - r.d_len for r in rows) if self.has_draft else 0))

    def choose_k(self, ctx: Context) -> tuple[int, str, int]:
        """(k, proposer, min_match), clamped; without a draft model every proposer is the
        n-gram one (see ``loop._Loop.choose_k``)."""
        choice = self.policy.choose(ctx)
        proposer, min_match = proposer_of(choice)
        if not self.has_draft:
            proposer = "ngram"
        k = min(int(choice), self.k_max, ctx.remaining - 1)
        longest = max(r.n for r in self.rows)
        if self.target_context is not None:
            k = min(k, self.target_context - longest)
        if self.draft_context is not None and proposer != "ngram":
            k = min(k, self.draft_context - longest + 1)
        return max(k, 0), proposer, min_match

    def ngram_blocks(self, k: int, proposer: str, min_match: int) -> list[list[int]] | None:
        """Each row's n-gram block (≤ k tokens, and never past what the row can keep; []
        where it has no usable match), or None when no row has one (the iteration is a plain
        step, or the draft model's)."""
        blocks = []
        for r in self.rows:
            toks, matched = r.ngram.propose(min(k, r.limit - r.gen - 1))
            blocks.append(toks if proposer != "hybrid" or matched >= min_match else [])
        return blocks if any(blocks) else None

    def step(self) -> None:
        rows = self.rows
        B = len(rows)
        ctx = self.context()
        k, proposer, min_match = self.choose_k(ctx)
        gens = [r.gen for r in rows]
        clock = self.clock

        # 0. The n-gram proposer's blocks, per row (host work); "ngram" rows of a hybrid
        # batch take theirs, the others the draft model's
        blocks = None
        ngram_s = 0.0
        if k > 0 and proposer != "draft":
            n0 = clock.mark()
            blocks = self.ngram_blocks(k, proposer, min_match)
            n1 = clock.mark()
            ngram_s = clock.seconds(n0, n1)
            clock.recycle(n0, n1)
            if blocks is None and (proposer == "ngram" or not self.has_draft):
                k = 0  # no row has a match: a plain step
            elif blocks is not None and proposer == "hybrid" and all(blocks):
                proposer = "ngram"  # every row has its block: the draft model need not run
        by_ngram = ([bool(b) for b in blocks] if blocks is not None and k > 0
                    else [False] * B)
        run_draft = k > 0 and not (proposer == "ngram")

        # 1. Draft k tokens for every row (the first forward carries each row's catch-up)
        q = None
        cu_rows = cu_known = None
        d_toks = torch.empty(B, k, dtype=torch.long, device=self.device)
        conf = []
        d0 = d1 = t_cu = d_start = None
        timed = 0
        if run_draft:
            catch = [r.tokens[r.d_len : r.n] for r in rows]
            known = [0 if self.sampling.uses_presence else
                     min(max(0, r.n - max(r.L, r.d_len + 1)), TRACE_CATCH_UP_MAX) for r in rows]
            keep0 = max(known) + 1
            d_seen = self.seen.clone() if self.seen is not None else None
            q_list = []
            d_start = clock.mark()
            raw = self.feed("d", catch, [r.d_len for r in rows], None, keep0)
            if max(known):
                cu_rows, cu_known = self.trace_catch_up(raw[:, :-1], known)
            # the prompt, or a k = 0 stretch (and its trace): a cost of resuming, not T_d
            wide = max(len(c) for c in catch) > 2
            if wide:
                t_cu = clock.mark()
            raw = raw[:, -1:]
            for i in range(k):
                if i:
                    raw = self.feed("d", None, [r.n + i - 1 for r in rows], d_toks[:, i - 1 : i], 1)
                s = self.process(raw, [g + i for g in gens], d_seen)
                if self.greedy:
                    tok = s[:, 0].argmax(dim=-1)  # [B]
                    if self.record_conf:
                        conf.append(s[:, 0].softmax(dim=-1).amax(dim=-1))
                else:
                    qi = logits_to_probs(s, self.sampling)  # [B, 1, V]
                    q_list.append(qi)
                    tok = sample(qi[:, 0], self.generator)
                    if self.record_conf:
                        conf.append(qi[:, 0].amax(dim=-1))
                d_toks[:, i] = tok
                if d_seen is not None:
                    d_seen[torch.arange(B, device=self.device), tok] = True
            d0, d1 = (t_cu if wide else d_start), clock.mark()
            timed = k - 1 if wide else k
            q = torch.cat(q_list, dim=1) if q_list else None
        lengths = None  # per-row block lengths, where some row proposes fewer than k
        if any(by_ngram):
            # n-gram rows: their own tokens, q one-hot (zero past a short block's end, so the
            # residual there is p itself); rows without a block propose nothing
            k_rows = [len(b) if used else (k if run_draft else 0)
                      for b, used in zip(blocks, by_ngram)]
            pad = [b + [0] * (k - len(b)) if used else None for b, used in zip(blocks, by_ngram)]
            rows_ng = [i for i, used in enumerate(by_ngram) if used]
            idx = torch.tensor(rows_ng, device=self.device)
            d_toks[idx] = torch.tensor([pad[i] for i in rows_ng], dtype=torch.long,
                                       device=self.device)
            if not run_draft:
                d_toks[[i for i in range(B) if not by_ngram[i]]] = 0
            if not self.greedy:
                if q is None:
                    q = torch.zeros(B, k, self.vocab, device=self.device)
                q[idx] = 0.0
                one = torch.zeros(len(rows_ng), k, self.vocab, device=self.device)
                one.scatter_(-1, d_toks[idx][..., None], 1.0)
                live_cols = (torch.arange(k, device=self.device)
                             < torch.tensor([k_rows[i] for i in rows_ng],
                                            device=self.device)[:, None])
                q[idx] = one * live_cols[..., None]
            if any(kr < k for kr in k_rows):
                lengths = torch.tensor(k_rows, device=self.device)
        block_conf = (None if not self.record_conf else  # [B, k]
                      quantize_beta(torch.stack(conf, dim=1)) if conf else d_toks)

        # 2. Score each row's new token + the k drafts in one target forward
        t0 = clock.mark()
        s_before = self.t_mask.shape[1]
        catch = [r.tokens[r.t_len : r.n] for r in rows]
        raw_t = self.feed("t", catch, [r.t_len for r in rows], d_toks, k + 1)
        s_t = self.process(raw_t, gens, self.seen, d_toks)  # [B, k+1, V]

        # 3. Verify every row
        p = None
        if self.greedy:
            tgt = s_t.argmax(dim=-1)  # [B, k+1]
            match = (d_toks == tgt[:, :k]).to(torch.int64)
            if lengths is not None:  # a short block ends: nothing past it is accepted
                match = match * (torch.arange(k, device=self.device) < lengths[:, None])
            num_acc = match.cumprod(dim=-1).sum(dim=-1)  # [B]
            nxt = tgt.gather(1, num_acc[:, None]).squeeze(1)
            block_trace = match
        else:
            from autospec.engine.verify import rejection_sample

            p = logits_to_probs(s_t, self.sampling)  # [B, k+1, V]
            num_acc, nxt = rejection_sample(p, q if q is not None else p[:, :0], d_toks,
                                            generator=self.generator, lengths=lengths)
            block_trace = (quantize_beta(torch.minimum(p[:, :k], q).sum(-1)) if k
                           else d_toks)
        t1 = clock.mark()

        # 4. The iteration's one host sync
        parts = [num_acc, nxt, d_toks.reshape(-1), block_trace.reshape(-1)]
        if block_conf is not None:
            parts.append(block_conf.reshape(-1))
        if cu_rows is not None:
            parts += [t.reshape(-1) for t in cu_rows if t is not None]
        if not self.greedy:
            parts.append(invalid_probs(p, q))
        vals = torch.cat(parts).tolist()
        if not self.greedy and vals.pop():
            raise_invalid_probs(p, q, min(gens))
        m_all, nxt_all = vals[:B], vals[B : 2 * B]
        off = 2 * B
        props = [vals[off + i * k : off + (i + 1) * k] for i in range(B)]
        off += B * k
        btrace = [vals[off + i * k : off + (i + 1) * k] for i in range(B)]
        off += B * k
        bconf = [()] * B
        if block_conf is not None:
            bconf = [vals[off + i * k : off + (i + 1) * k] for i in range(B)]
            off += B * k

        # timings: one (B, n) point per forward, shared by every row of the batch
        t_s = clock.seconds(t0, t1)
        first = self.iteration == 0
        d_per_token = None
        if run_draft and timed > 0:
            d_per_token = clock.seconds(d0, d1) / timed
        catch_up = None  # (tokens the forward took in: B × the widest row's, seconds)
        if t_cu is not None:
            catch_up = (B * ctx.draft_gap, clock.seconds(d_start, t_cu))
        clock.recycle(d_start, t_cu, d1, t0, t1)  # read: their events can be recorded again

        # 5. Per row: trace, emit, counters; then mask what was rejected
        unproposed: dict[int, list[float]] = {}
        shadow: dict[int, object] = {}  # row → (n-gram agreement, tokens emitted)
        t_mask_rows, d_mask_rows = [], []
        width_t = self.t_mask.shape[1] - s_before
        for b, r in enumerate(rows):
            m = m_all[b]
            st = r.stats
            # the positions before this catch-up were not the draft model's (k = 0, n-gram)
            was_off = bool(st.k_schedule) and (st.k_schedule[-1] == 0
                                               or st.proposer_schedule[-1] == 1)
            if cu_rows is not None and cu_known[b]:
                kn = cu_known[b]
                w = cu_rows[0].shape[1]
                cu_v = vals[off + b * w + w - kn : off + (b + 1) * w]
                cu_c = (vals[off + B * w + b * w + w - kn : off + B * w + (b + 1) * w]
                        if self.record_conf else ())
                r.trace.put(r.gen - kn, cu_v, cu_c)
                if was_off:
                    unproposed[b] = [v if self.greedy else v / 254 for v in cu_v
                                     if v != UNOBSERVED]
            kb = len(blocks[b]) if by_ngram[b] else (k if run_draft else 0)
            if not by_ngram[b]:  # an n-gram block's positions are left to the draft's catch-up
                on_prefix = min(m + 1, kb)
                r.trace.put(r.gen, btrace[b][:on_prefix], bconf[b][:on_prefix])
            st.iterations += 1
            st.k_schedule.append(kb)
            st.accepted_schedule.append(m)
            st.proposer_schedule.append(int(by_ngram[b]))
            if by_ngram[b]:
                st.ngram_drafts += 1
                st.ngram_drafted += kb
                st.ngram_accepted += m
                st.ngram_s += ngram_s / B
                _bump(st.ngram_drafted_per_position, kb)
                _bump(st.ngram_accepted_per_position, m)
            elif kb > 0:
                st.drafts += 1
                st.drafted += kb
                st.accepted += m
                _bump(st.drafted_per_position, kb)
                _bump(st.accepted_per_position, m)
            if first:
                st.prefill_s = t_s
            else:
                st.target_s_by_bn.setdefault((B, k + 1), []).append(t_s)
                if B == 1:
                    st.target_s_by_n.setdefault(k + 1, []).append(t_s)
            if d_per_token is not None:
                st.draft_s_by_b.setdefault(B, []).append(d_per_token)
                st.draft_s += d_per_token * timed
                st.draft_forwards += timed
            n_old = r.n
            new = props[b][:m] + [nxt_all[b]]
            if not by_ngram[b] and ctx.ngram_matches[b] and r.live is not None:
                shadow[b] = r.ngram.propose(len(new))[0]  # what the n-gram would have drafted
            self.emit(b, r, new, s_t, raw_t)
            if b in shadow:  # … against what was emitted (loop._Loop.step)
                seen = r.n - n_old
                shadow[b] = (agreement(shadow[b], new[:seen]), seen)
            # target cache: the row's catch-up and accepted drafts stay, rejected ones hidden
            r.t_len = n_old + m
            r.t_end = s_before + width_t - k + m
            if m < k:
                t_mask_rows.append((b, r.t_end, s_before + width_t))
            if run_draft:
                # an n-gram row keeps none of the draft's own proposals (they were not its)
                d_keep = 0 if by_ngram[b] else min(m, k - 1)
                r.d_len = n_old + d_keep
                d_total = self.d_mask.shape[1]
                r.d_end = d_total - (k - 1) + d_keep
                if d_keep < k - 1:
                    d_mask_rows.append((b, r.d_end, d_total))
            r.bonus = run_draft and not by_ngram[b] and m == k
        for b, a, z in t_mask_rows:
            self.t_mask[b, a:z] = 0
        for b, a, z in d_mask_rows:
            self.d_mask[b, a:z] = 0
        if not self.greedy:
            self.p_bonus = p[:, k] if run_draft else None

        # 6. Feed what was learned to the policy and the statistics
        accepted_rows = tuple(m_all)
        outcome = Outcome(drafted=k, accepted=sum(accepted_rows) // B,
                          draft_time_s=(d_per_token * k if d_per_token is not None
                                        else (0.0 if k == 0 else float("nan"))),
                          target_time_s=float("nan") if first else t_s,
                          accepted_rows=accepted_rows, batch_size=B)
        if catch_up is not None:  # the pair's catch-up fit, as the batch-1 loop feeds it
            for live in {id(r.live): r.live for r in rows if r.live is not None}.values():
                live.observe_catch_up(*catch_up)
        for b, r in enumerate(rows):
            if r.live is None:
                continue
            if b in unproposed:
                r.live.observe_unproposed(unproposed[b])
            timed_here = B == 1 and not first
            if by_ngram[b]:
                r.live.observe_ngram(len(blocks[b]), m_all[b], float("nan"),
                                     t_s if timed_here else float("nan"),
                                     match=ctx.ngram_matches[b])
            elif run_draft or k == 0:
                r.live.observe(k if run_draft else 0, m_all[b],
                               outcome.draft_time_s if timed_here else float("nan"),
                               t_s if timed_here else float("nan"))
            if b in shadow:
                r.live.observe_ngram_shadow(ctx.ngram_matches[b], *shadow[b])
        if self.costs is not None and not first:
            self.costs.observe(B, k + 1, t_s, d_per_token)
        outcome = replace(outcome, proposer="ngram" if any(by_ngram) else "draft")
        row_outcome = replace(outcome, unproposed=tuple(v for u in unproposed.values()
                                                        for v in u))
        self.policy.update(ctx, k, row_outcome)
        self.iteration += 1

        # 7. Rows that finished leave; caches are trimmed and, when holes pile up, repacked
        self.settle()
        self.compact()

    def trace_catch_up(self, raw, known: list[int]):
        """(trace values [B, w], confidences [B, w]) for the generated positions each row's
        catch-up forward predicted (the last known[b] columns of row b are meaningful)."""
        rows = self.rows
        w = raw.shape[1]
        s = self.process(raw, [r.gen - w for r in rows], None)
        beta = not self.greedy and self.p_bonus is not None
        probs = s.softmax(dim=-1) if self.record_conf or beta else None  # [B, w, V]
        conf = quantize_beta(probs.amax(dim=-1)) if self.record_conf else None
        if self.greedy:
            truth = torch.full((len(rows), w), -1, dtype=torch.long, device=self.device)
            for b, r in enumerate(rows):
                if known[b]:
                    truth[b, w - known[b]:] = torch.tensor(r.tokens[r.n - known[b] : r.n],
                                                           device=self.device)
            return ((s.argmax(dim=-1) == truth).to(torch.int64), conf), known
        vals = torch.full((len(rows), w), UNOBSERVED, dtype=torch.int64, device=self.device)
        if self.p_bonus is not None:
            for b, r in enumerate(rows):
                if known[b] == 1 and r.bonus and b < self.p_bonus.shape[0]:
                    vals[b, -1] = quantize_beta(torch.minimum(self.p_bonus[b], probs[b, -1]).sum())
        return (vals, conf), known

    def emit(self, b: int, r: _Row, new: list[int], s_t, raw_t) -> None:
        emitted = 0
        for tok in new:
            emitted += 1
            r.tokens.append(tok)
            if tok in self.eos_set:
                r.finished, r.stats.stop_reason = True, "eos"
                break
            if r.gen + emitted >= r.limit:
                r.finished = True
                r.stats.stop_reason = r.stats.stop_reason or "max_new_tokens"
                break
            if self.criteria is not None and r.stop_at is None:
                ids = torch.tensor(r.tokens, device=self.device)[None]
                if r.prefix is not None:
                    ids = torch.cat([r.prefix.to(self.device), ids], dim=1)
                if _criteria_hit(self.criteria, ids, s_t[b : b + 1, emitted - 1]):
                    r.stats.stop_reason = "stopping_criteria"
                    if self.eos_set:
                        r.finished = True
                        break
                    # generate pads finished rows only when it has an EOS criterion; without
                    # one a stopped row runs on until every row has stopped (settle)
                    r.stop_at = r.gen + emitted
        if r.scores is not None:
            r.scores.extend(s_t[b, j].clone() for j in range(emitted))
        if r.logits is not None:
            r.logits.extend(raw_t[b, j].float().clone() for j in range(emitted))
        if emitted and self.seen is not None:
            self.seen[b, torch.tensor(new[:emitted], device=self.device)] = True
        r.ngram.extend(new[:emitted])
        r.n += emitted
        if r.finished:
            r.wall_end = time.perf_counter()

    def settle(self) -> None:
        """Without an EOS criterion ``generate`` stops rows only all together: at the step where
        the last row is stopped by a criterion (or at max_new_tokens), every row has that many
        tokens. Once every row has stopped, cut the ones past that length and let the others
        run to it."""
        if self.eos_set or self.criteria is None:
            return
        if any(r.stop_at is None and r.stats.stop_reason != "max_new_tokens"
               for r in self.all_rows):
            return
        if any(r.stats.stop_reason == "max_new_tokens" for r in self.all_rows):
            return  # every row runs to max_new_tokens, as in generate
        end = max(r.stop_at for r in self.all_rows)
        for r in self.rows:
            if r.gen >= end:
                extra = r.gen - end
                if extra:
                    del r.tokens[len(r.tokens) - extra :]
                    for out in (r.scores, r.logits):
                        if out is not None:
                            del out[len(out) - extra :]
                    r.n -= extra
                r.finished = True
                r.wall_end = time.perf_counter()
            r.limit = end

    # -- compaction ----------------------------------------------------------------------------
    def compact(self) -> None:
        keep = [b for b, r in enumerate(self.rows) if not r.finished]
        if len(keep) < len(self.rows):
            self.rows = [self.rows[b] for b in keep]
            if not keep:
                return
            idx = torch.tensor(keep, device=self.device)
            for cache in (self.t_cache, self.d_cache):
                if cache is not None:
                    cache.batch_select_indices(idx)
            self.t_mask, self.d_mask = self.t_mask[idx], self.d_mask[idx]
            if self.seen is not None:
                self.seen = self.seen[idx]
            if self.p_bonus is not None:
                self.p_bonus = self.p_bonus[idx]
        self.t_mask = self._trim(self.t_cache, self.t_mask, "t")
        if self.d_cache is not None:
            self.d_mask = self._trim(self.d_cache, self.d_mask, "d")

    def _trim(self, cache, mask: torch.Tensor, which: str) -> torch.Tensor:
        """Cut trailing slots no row uses; repack when masked slots pile up."""
        rows = self.rows
        ends = [r.t_end if which == "t" else r.d_end for r in rows]
        lens = [r.t_len if which == "t" else r.d_len for r in rows]
        S = mask.shape[1]
        end = max(ends)
        if end < S:
            _crop(cache, S - end)
            mask = mask[:, :end]
            S = end
        longest = max(lens)
        if S - longest <= max(SLACK, S // 4):
            return mask
        # gather each row's valid slots to the right: row b's tokens end at slot `longest`
        order = torch.arange(S, device=self.device).expand(len(rows), S)
        valid = mask.bool()
        key = torch.where(valid, order + S, order)  # valid slots sort after the holes
        gather = key.argsort(dim=1, stable=True)[:, S - longest :]  # [B, longest]
        new_mask = valid.gather(1, gather).to(mask.dtype)
        for layer in getattr(cache, "layers", []):
            keys = getattr(layer, "keys", None)
            if keys is None or keys.dim() != 4 or keys.shape[-2] != S:
                continue
            g = gather[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            layer.keys = keys.gather(2, g)
            layer.values = layer.values.gather(2, g)
        for r in rows:
            if which == "t":
                r.t_end = longest
            else:
                r.d_end = longest
        self.repacks += 1
        return new_mask

    # -- the end -------------------------------------------------------------------------------
    def result(self) -> BatchResult:
        out = []
        for r in self.all_rows:
            st = r.stats
            st.new_tokens = r.gen
            st.trace = r.trace.finish(st.new_tokens)
            if self.record_conf:
                st.confidence = r.trace.finish_confidence(st.new_tokens)
            st.batch_size = self.batch0
            st.peak_kv_bytes = self.peak_kv
            st.cache_repacks = self.repacks
            st.wall_s = (r.wall_end or time.perf_counter()) - self.t_start
            st.path = "eager"
            # what the store's writer computes the row's n-gram trace from, as at batch 1
            st.tokens = (r.tokens if len(r.tokens) == st.prompt_tokens + st.new_tokens
                         else None)
            st.ngram_settings = {"max_n": int(getattr(r.ngram, "max_n", DEFAULT_MAX_N)),
                                 "min_n": int(getattr(r.ngram, "min_n", DEFAULT_MIN_N))}
            seq = torch.tensor(r.tokens, dtype=torch.long, device=self.device)[None]
            out.append(LoopResult(sequences=seq, stats=st, scores=r.scores, logits=r.logits))
        return BatchResult(rows=out, peak_kv_bytes=self.peak_kv,
                           wall_s=time.perf_counter() - self.t_start)


def _crop(cache, drop: int) -> None:
    if drop > 0 and cache.get_seq_length() > 0:
        cache.crop(-drop)
