"""The exact draft → verify loop (batch 1).

Invariants at the top of every iteration, with ``n`` tokens known (prompt + generated):
- the target's cache holds ``buf[:t_len]`` and the draft's ``buf[:d_len]``, t_len, d_len < n;
  whatever each has not seen yet is fed at its next forward ("catch-up" tokens). The first
  iteration's catch-up is the prompt itself, so prefill and the first step share one forward.
- k = 0 is a plain decoding step: the target scores one position and the draft does nothing
  (it catches up in one forward when drafting resumes).

One iteration (``_Loop.step``):
1. Draft k tokens autoregressively from the draft's cache (sampling from q, or argmax).
2. Score catch-up + k draft tokens in one target forward → p at the k+1 positions.
3. Verify: accepted + one recovered/bonus token (``verify.py``).
4. One host sync: the accepted count, the next token, the draft tokens and the iteration's
   acceptance-trace values come back together.
5. Emit tokens, stopping exactly where ``generate`` would (max_new_tokens, EOS, criteria).
6. Crop both caches to what was kept.

Forwards and crops go through runners (``autospec.engine.runners``): transformers' DynamicCache by
default, or, with ``static_cache=True``, a static KV cache whose forwards replay CUDA graphs.

The draft scores its last proposal without a forward of its own: when all k are accepted, that
proposal and the bonus token are fed together at the start of the next iteration (a 2-token
forward costs about what a 1-token one does), which keeps the caches in sync and yields the
draft's distribution at the bonus position one iteration later.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from autospec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramIndex, agreement
from autospec.policies.base import (
    Context,
    Outcome,
    Policy,
    early_stop_of,
    proposer_of,
    stops_drafting,
)
from autospec.policies.live import LiveStats
from autospec.engine.runners import open_runner, resolve_graphs
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
from autospec.telemetry import Clock, Trace, quantize_beta
from autospec.engine.verify import greedy_verify, rejection_sample

log = logging.getLogger(__name__)

__all__ = ["LoopStats", "LoopResult", "speculative_generate", "DraftInput"]


@dataclass
class LoopStats:
    """Counters for one request, in vLLM's convention: mean acceptance length counts the
    bonus/recovered token, so plain decoding has length 1."""

    iterations: int = 0
    drafts: int = 0  # iterations with k > 0
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    k_schedule: list[int] = field(default_factory=list)
    new_tokens: int = 0
    prompt_tokens: int = 0
    prefill_s: float = 0.0  # first target forward (prompt + first block)
    draft_prefill_s: float = 0.0  # draft forwards that caught up on > 2 tokens (the prompt)
    # each of those catch-ups: (tokens it took in, seconds, its first proposal included), the
    # points of the cost C(g) the policy prices resuming the draft model with (batch 1)
    draft_catch_ups: list[tuple[int, float]] = field(default_factory=list)
    draft_s: float = 0.0  # the other draft forwards (one token each, or two after a bonus)
    draft_forwards: int = 0
    target_s_by_n: dict[int, list[float]] = field(default_factory=dict)  # scored tokens → times
    target_forwards: list[tuple[int, float]] = field(default_factory=list)  # (cached, seconds)
    accepted_schedule: list[int] = field(default_factory=list)  # per iteration, with k_schedule
    trace: bytes = b""  # acceptance trace, one byte per generated token (autospec.telemetry)
    trace_kind: str = ""
    confidence: bytes = b""  # the draft's top probability per generated token (telemetry.Trace)
    wall_s: float = 0.0
    started_at: float = 0.0  # time.time() at the start, for matching NVML samples
    stop_reason: str = ""
    path: str = ""  # how forwards ran: "eager", "static", "static+cuda-graphs" (target/draft)
    batch_size: int = 1  # rows of the generate call this request ran in
    # at batch > 1: forwards by (rows in the batch then, tokens scored per row) → seconds,
    # and the draft's seconds per proposed token by rows in the batch (shared by every row)
    target_s_by_bn: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    draft_s_by_b: dict[int, list[float]] = field(default_factory=dict)
    peak_kv_bytes: int = 0  # the largest target + draft KV cache the request held (batch > 1)
    # iterations drafted by the n-gram proposer (prompt lookup) instead of the draft model:
    # counted apart, so that the draft model's acceptance above stays the draft model's
    ngram_drafts: int = 0
    ngram_drafted: int = 0
    ngram_accepted: int = 0
    ngram_accepted_per_position: list[int] = field(default_factory=list)
    ngram_drafted_per_position: list[int] = field(default_factory=list)
    proposer_schedule: list[int] = field(default_factory=list)  # per iteration: 1 = n-gram
    ngram_s: float = 0.0  # host time of the n-gram lookups
    # batch 1: the request's tokens, prompt + generated (the n-gram index's host list: no
    # device sync; do not modify it) and the index's {"max_n", "min_n"}, from which the
    # store's writer computes the n-gram trace (autospec.ngram.ngram_trace); per row at batch > 1
    tokens: list[int] | None = None
    ngram_settings: dict[str, int] | None = None
    cache_repacks: int = 0  # batch > 1: times the caches' masked slots were squeezed out

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def target_time(self, n: int) -> float:
        """Median time of a target forward scoring n tokens (after the prefill)."""
        times = sorted(self.target_s_by_n.get(n, []))
        return times[len(times) // 2] if times else float("nan")

    @property
    def draft_time(self) -> float:
        return self.draft_s / self.draft_forwards if self.draft_forwards else float("nan")


@dataclass
class LoopResult:
    sequences: torch.Tensor  # [1, L + new]
    stats: LoopStats
    scores: list[torch.Tensor] | None = None  # processed target scores, [1, V] per new token
    logits: list[torch.Tensor] | None = None  # raw target logits, [1, V] per new token


def _fit_vocab(raw: torch.Tensor, vocab: int) -> torch.Tensor:
    """Fit the draft's logits to the target's vocabulary. Ids the draft lacks get −inf (q = 0);
    ids the target lacks are cut, so the draft never proposes a token the target cannot embed.
    Either way q is still the distribution the draft samples from: the rule stays exact."""
    extra = vocab - raw.shape[-1]
    if extra == 0:
        return raw
    if extra < 0:
        return raw[..., :vocab]
    return torch.nn.functional.pad(raw, (0, extra), value=float("-inf"))


class DraftInput:
    """Ids the draft can embed. A target with more embedding rows than the draft (padded
    vocabularies: Qwen2.5-7B has 152064 rows, its 0.5B draft 151936) can emit, or be prompted
    with, ids the draft has no row for. The draft reads each such id as ``placeholder`` (its
    pad id, else 0): that changes only what the draft proposes, never the output, because the
    draft's q is still the distribution its proposals are drawn from, which is all the
    rejection rule needs (and greedy verification only compares with the target's argmax).
    The mapping is one device-side ``where``, applied only when the draft has fewer rows."""

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


def host_tokens(ids: torch.Tensor) -> list[int] | None:
    """Row 0 of ``ids`` as ints when it is in host memory (no device read); None on a device,
    where reading it would be a sync of its own."""
    return ids[0].numpy().tolist() if ids.device.type == "cpu" else None


def _embedding_rows(model) -> int:
    return model.get_input_embeddings().weight.shape[0]


def speculative_generate(target, draft, input_ids: torch.Tensor, *, sampling: SamplingConfig,
                         policy: Policy, max_new_tokens: int, **options) -> LoopResult:
    """Generate exactly as ``target.generate`` would, speculating with ``draft`` (None: the
    n-gram proposer alone) and, where the policy chooses it, the n-gram proposer.

    input_ids: [1, L]. Options: min_new_tokens, eos_token_ids, stopping_criteria, streamer,
    generator, category, k_max, target_context, draft_context, output_scores, output_logits,
    live (the category's LiveStats, fed every iteration and shown to the policy),
    static_cache (False: transformers' DynamicCache, the reference; True: a static KV cache
    reused across requests, see autospec.engine.runners), cuda_graphs ("auto": with static_cache on
    a CUDA device, replay forwards from CUDA graphs; True, False, "emulate"),
    record_confidence (keep the draft's top probability per generated token in
    ``stats.confidence``, which only the store uses: off, no softmax runs for it),
    ngram (the n-gram proposer: a callable ``tokens -> index`` with ``extend(tokens)``,
    ``match() -> (match length, end)`` and ``propose(k) -> (tokens, match length)``, e.g.
    ``functools.partial(NgramIndex, max_n=4)``; default ``NgramIndex``).
    """
    loop = _Loop(target, draft, input_ids, sampling, policy, max_new_tokens, **options)
    try:
        with torch.inference_mode():
            while not loop.finished:
                loop.step()
    finally:
        loop.t_run.release()
        if loop.d_run is not None:
            loop.d_run.release()
    return loop.result()


class _Loop:
    """The state of one request; ``step`` runs one draft → verify iteration."""

    def __init__(self, target, draft, input_ids, sampling: SamplingConfig, policy: Policy,
                 max_new_tokens: int, *, min_new_tokens: int = 0,
                 eos_token_ids: tuple[int, ...] = (), stopping_criteria=None, streamer=None,
                 generator: torch.Generator | None = None, category: str = "default",
                 k_max: int = 16, target_context: int | None = None,
                 draft_context: int | None = None, output_scores: bool = False,
                 output_logits: bool = False, live=None, static_cache: bool = False,
                 cuda_graphs="auto", record_confidence: bool = False, ngram=None):
        self.t_start = time.perf_counter()
        self.device = device = input_ids.device
        self.L = L = input_ids.shape[1]
        self.sampling, self.policy, self.generator = sampling, policy, generator
        self.greedy = not sampling.do_sample
        self.max_new, self.min_new = max_new_tokens, min_new_tokens
        self.criteria, self.streamer = stopping_criteria, streamer
        self.category, self.k_max, self.live = category, k_max, live
        # draft-side early stopping (depends only on the draft's own distribution: exact)
        self.early_stop = early_stop_of(policy, category)
        # the draft's top probability: for early stopping, and kept only for the store
        self.record_conf = record_confidence
        self.need_top = record_confidence or self.early_stop is not None
        self.target_context, self.draft_context = target_context, draft_context
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.has_draft = draft is not None
        # ids the draft lacks, read as its pad
        self.draft_input = DraftInput(target, draft) if self.has_draft else None
        # the n-gram proposer's index over prompt + generated tokens, kept as tokens are
        # emitted (a few dictionary inserts per token; see autospec.ngram). A prompt in host
        # memory is read as it is; on a GPU it comes back with the first iteration's host
        # sync instead of costing a read of its own (the n-gram then proposes from the second
        # iteration on)
        self.ngram_factory = NgramIndex if ngram is None else ngram
        prompt = host_tokens(input_ids)
        self.ngram = None if prompt is None else self.ngram_factory(prompt)
        self.proposers = ("draft", "ngram") if self.has_draft else ("ngram",)
        self.stats = LoopStats(prompt_tokens=L, started_at=time.time(),
                               trace_kind=TRACE_GREEDY if self.greedy else TRACE_SAMPLED)
        self.scores_out = [] if output_scores else None
        self.logits_out = [] if output_logits else None
        self.buf = torch.empty(1, L + max_new_tokens + k_max + 1, dtype=torch.long, device=device)
        self.buf[:, :L] = input_ids
        self.n = L  # tokens known: prompt + generated
        self.t_len = self.d_len = 0  # tokens each cache holds
        # this request so far, for the policy: its own statistics (undiscounted), fed as
        # its category's are — its rate, its n-gram match points, blocks and shadow
        self.request = LiveStats(discount=1.0)
        self.eos = (torch.tensor(eos_token_ids, dtype=torch.long, device=device)
                    if eos_token_ids else None)
        self.eos_set = set(eos_token_ids)
        # tokens seen so far, for the repetition penalty (kept incrementally, never rescanned)
        self.seen = seen_tokens(input_ids, self.vocab) if sampling.uses_presence else None
        self.clock = Clock(device)
        # (what, count, start mark, end mark, …) until the iteration's sync, then (what, count,
        # seconds, …): the marks are read and handed back to the clock for reuse
        self.timings: list[tuple] = []
        self.trace = Trace(self.greedy, max_new_tokens)
        self.p_bonus = None  # sampling: p at the last bonus position, until the draft scores it
        self.finished = False
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # last, so that nothing after it can fail and leave a static runner marked busy
        graphs = resolve_graphs(cuda_graphs, device) if static_cache else None
        need = L + max_new_tokens + 1
        self.t_run = open_runner(target, need, static=static_cache, graphs=graphs)
        self.d_run = None
        try:
            if self.has_draft:
                self.d_run = open_runner(draft, need, static=static_cache, graphs=graphs)
        except BaseException:
            self.t_run.release()
            raise
        paths = {self.t_run.path} | ({self.d_run.path} if self.d_run is not None else set())
        self.stats.path = (paths.pop() if len(paths) == 1
                           else f"{self.t_run.path}/{self.d_run.path}")

    # -- logits processing, as generate would do it at each position ------------------------
    def banned_at(self, first_gen: int, npos: int) -> torch.Tensor | None:
        """EOS is suppressed at positions whose generated count is below min_new_tokens."""
        if self.eos is None or first_gen >= self.min_new:
            return None
        rows = torch.arange(first_gen, first_gen + npos, device=self.device) < self.min_new
        mask = torch.zeros(npos, self.vocab, dtype=torch.bool, device=self.device)
        mask[:, self.eos] = rows[:, None]
        return mask

    def process(self, raw, first_gen: int, base_seen, block=None) -> torch.Tensor:
        """raw [1, npos, V] → processed scores; position j has seen base_seen + block[:, :j]."""
        raw = _fit_vocab(raw, self.vocab)
        npos = raw.shape[1]
        pos_seen = None if base_seen is None else block_presence(base_seen, block, npos)
        return process_logits(raw, self.sampling, seen=pos_seen,
                              banned=self.banned_at(first_gen, npos))

    # -- one iteration --------------------------------------------------------------------------
    def choose_k(self, ctx: Context) -> tuple[int, str, int]:
        """(k, proposer, min_match): the policy's choice, clamped to what can be kept. An int
        is the draft model's k; without a draft model every proposer is the n-gram one."""
        choice = self.policy.choose(ctx)
        proposer, min_match = proposer_of(choice)
        if not self.has_draft:
            proposer = "ngram"
        # every iteration emits at least one token: never draft past what can be kept
        k = min(int(choice), self.k_max, ctx.remaining - 1)
        if self.target_context is not None:
            k = min(k, self.target_context - self.n)
        if self.draft_context is not None and proposer != "ngram":
            k = min(k, self.draft_context - self.n + 1)
        return max(k, 0), proposer, min_match

    def ngram_block(self, k: int, proposer: str, min_match: int) -> torch.Tensor | None:
        """The n-gram proposer's block, [1, k'] with 1 ≤ k' ≤ k, or None: no match ("ngram":
        the iteration is a plain step), or a match shorter than ``min_match`` ("hybrid": the
        draft model drafts instead). Host work only: a few dictionary probes."""
        t0 = self.clock.mark()
        toks, matched = self.ngram.propose(k) if self.ngram is not None else ([], 0)
        if proposer == "hybrid" and matched < min_match and self.has_draft:
            toks = []
        self.timings.append(("ngram", len(toks), t0, self.clock.mark()))
        if not toks:
            return None
        return torch.tensor([toks], dtype=torch.long, device=self.device)

    def draft_block(self, k: int, gen: int):
        """Propose k tokens. Returns (tokens [1, k], q [1, k, V] or None, the draft's quantized
        top probability per proposed token [k] (None unless recorded), (trace values,
        confidences or None) for already generated positions the catch-up forward scored, or
        None)."""
        buf, n = self.buf, self.n
        d_toks = torch.empty(1, k, dtype=torch.long, device=self.device)
        q_list, conf = [], []
        feed = self.draft_input(buf[:, self.d_len : n])
        # catch-up rows whose predictions are generated tokens already known: trace material
        known = min(max(0, n - max(self.L, self.d_len + 1)), TRACE_CATCH_UP_MAX)
        if self.sampling.uses_presence:  # their penalties would need the past seen-sets: skip
            known = 0
        catch_up_trace = None
        timed = k  # forwards inside the "draft" timing: T_d is the cost of one proposal
        t0 = self.clock.mark()
        d_seen = self.seen.clone() if self.seen is not None else None
        for i in range(k):
            if i == 0:
                raw = self.d_run.run(feed, known + 1)  # [1, known+1, V]
                if known:
                    catch_up_trace = self.trace_catch_up(raw[:, :known], n - known - self.L)
                if feed.shape[1] > 2:
                    # the prompt, or the tokens decoded at k = 0, and the trace read from their
                    # predictions: a cost of resuming, not T_d (counted as T_d it made a draft
                    # look 4× dearer after every k = 0 stretch, and the cost model kept
                    # speculation off on traffic where it paid)
                    mid = self.clock.mark()
                    self.timings.append(("draft_catch_up", feed.shape[1], t0, mid))
                    t0 = mid
                    timed -= 1
                raw = raw[:, -1:]
            else:
                raw = self.d_run.run(feed, 1)  # [1, 1, V]
            s = self.process(raw, gen + i, d_seen)
            top = None
            if self.greedy:
                tok = s[:, 0].argmax(dim=-1)  # [1]
                if self.need_top:
                    top = s[0, 0].softmax(dim=-1).max()
            else:
                q = logits_to_probs(s, self.sampling)  # [1, 1, V]
                q_list.append(q)
                tok = sample(q[:, 0], self.generator)  # [1]
                if self.need_top:
                    top = q[0, 0].max()
            if self.record_conf:
                conf.append(top)
            d_toks[:, i] = tok
            if d_seen is not None:
                d_seen[0, tok] = True
            feed = d_toks[:, i : i + 1]
            if (self.early_stop is not None and i + 1 < k
                    and stops_drafting(int(quantize_beta(top)), self.early_stop)):
                timed -= k - i - 1
                k = i + 1  # a sync per draft token: the price of this option on a GPU
                d_toks = d_toks[:, :k]
                break
        self.timings.append(("draft", timed, t0, self.clock.mark()))
        self.d_len = n + k - 1
        conf_t = quantize_beta(torch.stack(conf)) if self.record_conf and conf else None
        return d_toks, (torch.cat(q_list, dim=1) if q_list else None), conf_t, catch_up_trace

    def trace_catch_up(self, raw, first_gen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(trace values, quantized draft confidences) for generated positions first_gen …
        from the draft's catch-up rows: it predicted them from the target's own prefix.
        Early stopping stops when the draft's top probability (this confidence) falls below
        its threshold (AdaEDL/DISCO style), so replay can apply any threshold to it."""
        s = self.process(raw, first_gen, None)
        count = raw.shape[1]
        beta = not self.greedy and self.p_bonus is not None and count == 1
        probs = s[0].softmax(dim=-1) if self.record_conf or beta else None  # [count, V]
        conf = quantize_beta(probs.max(dim=-1).values) if self.record_conf else None
        if self.greedy:
            truth = self.buf[0, self.L + first_gen : self.L + first_gen + count]
            return (s[0].argmax(dim=-1) == truth).to(torch.int64), conf
        if not beta:
            return torch.full((count,), 255, dtype=torch.int64, device=self.device), conf
        return quantize_beta(torch.minimum(self.p_bonus, probs[0]).sum())[None], conf

    def step(self) -> None:
        stats, buf, n = self.stats, self.buf, self.n
        gen = n - self.L
        ctx = Context(category=self.category, k_max=self.k_max, generated=gen,
                      remaining=self.max_new - gen, live=self.live, proposers=self.proposers,
                      ngram_match=self.ngram.match()[0] if self.ngram is not None else 0,
                      draft_gap=n - self.d_len if self.has_draft else 0, request=self.request)
        k, proposer, min_match = self.choose_k(ctx)
        first_timing = len(self.timings)

        # 1. Draft k tokens (k = 0: nothing; the draft catches up when drafting resumes).
        # The n-gram proposer's tokens are a function of the context: q is one-hot at each
        # (accepted with probability p(x); on rejection the residual is p without x)
        q = catch_up_trace = d_toks = None
        used = "draft"
        if k > 0 and proposer != "draft":
            d_toks = self.ngram_block(k, proposer, min_match)
            if d_toks is not None:
                used, k = "ngram", d_toks.shape[1]
                if not self.greedy:
                    q = torch.zeros(1, k, self.vocab, device=self.device)
                    q.scatter_(-1, d_toks[..., None], 1.0)
            elif proposer == "ngram" or not self.has_draft:
                k = 0  # nothing to propose: a plain step
        if d_toks is not None:
            block_conf = None
        elif k > 0:
            d_toks, q, block_conf, catch_up_trace = self.draft_block(k, gen)
            k = d_toks.shape[1]  # early stopping may have drafted fewer
        else:
            d_toks = torch.empty(1, 0, dtype=torch.long, device=self.device)
            block_conf = d_toks[0] if self.record_conf else None

        # 2. Score catch-up + drafts in one target forward
        t0 = self.clock.mark()
        cached = self.t_len
        raw_t = self.t_run.run(torch.cat([buf[:, cached:n], d_toks], dim=1), k + 1)
        s_t = self.process(raw_t, gen, self.seen, d_toks)  # [1, k+1, V]

        # 3. Verify, and the trace values of the block's positions
        if self.greedy:
            tgt = s_t.argmax(dim=-1)  # [1, k+1]
            num_acc, nxt = greedy_verify(tgt, d_toks)
            block_trace = (d_toks[0] == tgt[0, :k]).to(torch.int64)
        else:
            p = logits_to_probs(s_t, self.sampling)  # [1, k+1, V]
            num_acc, nxt = rejection_sample(p, q if q is not None else p[:, :0], d_toks,
                                            generator=self.generator)
            block_trace = (quantize_beta(torch.minimum(p[0, :k], q[0]).sum(-1)) if k
                           else d_toks[0])
        self.t_len = n + k
        t_end = self.clock.mark()

        # 4. The iteration's one host sync (with, when sampling, multinomial's validity check
        # that `sample` leaves out: NaN probabilities would otherwise pass as tokens)
        parts = [num_acc, nxt, d_toks[0], block_trace]
        if block_conf is not None:
            parts.append(block_conf)
        if catch_up_trace is not None:
            parts += [t for t in catch_up_trace if t is not None]  # (values, confidences)
        if self.ngram is None:  # the first iteration: the prompt, for the n-gram index
            parts.append(buf[0, : self.L])
        if not self.greedy:
            parts.append(invalid_probs(p, q))
        vals = torch.cat(parts).tolist()
        if not self.greedy and vals.pop():
            raise_invalid_probs(p, q, gen)
        if self.ngram is None:
            self.ngram = self.ngram_factory(vals[len(vals) - self.L :])
            del vals[len(vals) - self.L :]
        m, nxt_id = vals[0], vals[1]
        proposed = vals[2 : 2 + k]
        block_vals = vals[2 + k : 2 + 2 * k]
        off = 2 + 2 * k
        block_conf_vals = ()
        if block_conf is not None:
            block_conf_vals, off = vals[off : off + k], off + k
        unproposed = []
        if catch_up_trace is not None:
            cu = vals[off:]
            half = len(cu) // 2 if self.record_conf else len(cu)
            self.trace.put(gen - half, cu[:half], cu[half:])
            # positions the draft model did not propose (decoded at k = 0 or by the n-gram)
            if stats.k_schedule and (stats.k_schedule[-1] == 0 or stats.proposer_schedule[-1]):
                unproposed = [v if self.greedy else v / 254 for v in cu[:half]
                              if v != UNOBSERVED]
        # past the first rejection the draft ran off the target's prefix: not trace material.
        # An n-gram block is not the draft model's: its positions are left to the draft's
        # catch-up, which predicts them from the target's prefix when the draft runs again
        if used == "draft":
            on_prefix = min(m + 1, k)
            self.trace.put(gen, block_vals[:on_prefix], block_conf_vals[:on_prefix])
        self.p_bonus = (p[:, k].squeeze(0) if used == "draft" and not self.greedy and k and m == k
                        else None)
        what = "target_prefill" if stats.iterations == 0 else "target"
        self.timings.append((what, k + 1, t0, t_end, cached))

        # 5. Emit, stopping where generate would. Where the n-gram had a match but did not
        # draft, its would-be block is compared with what was emitted: free evidence of where
        # it pays (a dictionary probe and a list compare; ``LiveStats.observe_ngram_shadow``)
        new = proposed[:m] + [nxt_id]
        shadow = (self.ngram.propose(len(new))[0]
                  if used != "ngram" and ctx.ngram_match and ctx.live is not None else None)
        before = self.n
        self.emit(new, d_toks, nxt, m, s_t, raw_t)
        stats.iterations += 1
        stats.k_schedule.append(k)
        stats.accepted_schedule.append(m)
        stats.proposer_schedule.append(int(used == "ngram"))
        if k > 0 and used == "ngram":
            stats.ngram_drafts += 1
            stats.ngram_drafted += k
            stats.ngram_accepted += m
            _bump(stats.ngram_drafted_per_position, k)
            _bump(stats.ngram_accepted_per_position, m)
        elif k > 0:
            stats.drafts += 1
            stats.drafted += k
            stats.accepted += m
            _bump(stats.drafted_per_position, k)
            _bump(stats.accepted_per_position, m)
        self.timings[first_timing:] = self.read_marks(self.timings[first_timing:])
        outcome = replace(self.outcome(k, m, self.timings[first_timing:]),
                          unproposed=tuple(unproposed), proposer=used)
        if ctx.live is not None:
            ctx.live.observe_unproposed(outcome.unproposed)
        if shadow:
            seen = self.n - before
            shadow = (ctx.ngram_match, agreement(shadow, new[:seen]), seen)
        for live in [x for x in (ctx.live, self.request) if x is not None]:
            if self.ngram is not None:
                live.observe_match(ctx.ngram_match > 0)
            for what, count, sec, *_ in self.timings[first_timing:]:
                if what == "draft_catch_up":
                    live.observe_catch_up(count, sec)
            if used == "ngram":  # the draft model's statistics stay the draft model's
                live.observe_ngram(k, m, outcome.draft_time_s, outcome.target_time_s,
                                   match=ctx.ngram_match)
            else:
                live.observe(k, m, outcome.draft_time_s, outcome.target_time_s)
                if shadow:
                    live.observe_ngram_shadow(*shadow)
        self.policy.update(ctx, k, outcome)

        # 6. Keep only what was kept in both caches
        if not self.finished:
            self.t_run.crop(self.n - 1)
            self.t_len = self.n - 1
            if self.d_run is not None and self.d_len > self.n - 1:
                self.d_run.crop(self.n - 1)
                self.d_len = self.n - 1

    def emit(self, new: list[int], d_toks, nxt, m: int, s_t, raw_t) -> None:
        n, buf = self.n, self.buf
        buf[:, n : n + m] = d_toks[:, :m]  # device-side copies: no host round trip
        buf[:, n + m] = nxt
        emitted = 0
        for tok in new:
            emitted += 1
            if tok in self.eos_set:
                self.finished, self.stats.stop_reason = True, "eos"
                break
            if self.criteria is not None and _criteria_hit(
                    self.criteria, buf[:, : n + emitted], s_t[:, emitted - 1]):
                self.finished, self.stats.stop_reason = True, "stopping_criteria"
                break
        if self.scores_out is not None:
            self.scores_out.extend(s_t[:, j].clone() for j in range(emitted))
        if self.logits_out is not None:
            self.logits_out.extend(raw_t[:, j].float().clone() for j in range(emitted))
        if self.seen is not None:
            self.seen[0, buf[0, n : n + emitted]] = True
        self.ngram.extend(new[:emitted])
        if self.streamer is not None:
            self.streamer.put(torch.tensor(new[:emitted]))
        self.n += emitted
        if self.n - self.L >= self.max_new and not self.finished:
            self.finished, self.stats.stop_reason = True, "max_new_tokens"

    def read_marks(self, timings: list[tuple]) -> list[tuple]:
        """An iteration's timings with seconds in place of its marks, read after its sync (on
        CUDA the events have completed), and the marks recycled."""
        out = [(what, count, self.clock.seconds(a, b), *rest)
               for what, count, a, b, *rest in timings]
        self.clock.recycle(*(mark for t in timings for mark in t[2:4]))
        return out

    def outcome(self, k: int, m: int, timings: list[tuple]) -> Outcome:
        """What the policy learns from this iteration. Times are per-iteration costs of the
        steady state: the first target forward (prefill) and draft catch-ups over the prompt
        are left out (NaN), so they never pose as T_t(k+1) or T_d. CUDA events are read here
        only because the iteration's sync has already completed them (``read_marks``)."""
        d_s = t_s = float("nan")
        for what, count, sec, *_ in timings:
            if what in ("draft", "ngram") and count:  # scaled to k proposals (a catch-up
                d_s = sec * k / count  # took one)
            elif what == "target":
                t_s = sec
        return Outcome(drafted=k, accepted=m, draft_time_s=d_s if k else 0.0, target_time_s=t_s)

    # -- the end ------------------------------------------------------------------------------
    def result(self) -> LoopResult:
        if self.streamer is not None:
            self.streamer.end()
        stats = self.stats
        stats.new_tokens = self.n - self.L
        stats.trace = self.trace.finish(stats.new_tokens)
        if self.record_conf:
            stats.confidence = self.trace.finish_confidence(stats.new_tokens)
        for what, count, sec, *rest in self.timings:  # read iteration by iteration
            if what == "draft":
                if count:  # k = 1 after a catch-up: no proposal forward left to time
                    stats.draft_s += sec
                    stats.draft_forwards += count
            elif what == "draft_catch_up":
                stats.draft_prefill_s += sec
                stats.draft_catch_ups.append((count, sec))
            elif what == "ngram":  # host time of the lookup: the n-gram proposer's T_d
                stats.ngram_s += sec
            elif what == "target_prefill":
                stats.prefill_s = sec
            else:
                stats.target_s_by_n.setdefault(count, []).append(sec)
                stats.target_forwards.append((rest[0], sec))
        # what the n-gram trace is computed from, later, off this thread (a custom index
        # without the host list leaves it None: no trace rather than a device sync)
        tokens = getattr(self.ngram, "tokens", None)
        stats.tokens = tokens if isinstance(tokens, list) and len(tokens) == self.n else None
        stats.ngram_settings = {"max_n": int(getattr(self.ngram, "max_n", DEFAULT_MAX_N)),
                                "min_n": int(getattr(self.ngram, "min_n", DEFAULT_MIN_N))}
        stats.wall_s = time.perf_counter() - self.t_start
        return LoopResult(sequences=self.buf[:, : self.n].clone(), stats=stats,
                          scores=self.scores_out, logits=self.logits_out)


def _bump(counts: list[int], upto: int) -> None:
    """counts[i] += 1 for i < upto, growing the list as needed."""
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


def _criteria_hit(criteria, ids: torch.Tensor, scores: torch.Tensor) -> bool:
    hit = criteria(ids, scores)
    return bool(hit.any()) if isinstance(hit, torch.Tensor) else bool(hit)
