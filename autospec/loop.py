"""The exact draft → verify loop (batch 1).

Invariants at the top of every iteration, with ``n`` tokens known (prompt + generated):
- the target's cache holds ``buf[:t_len]`` and the draft's ``buf[:d_len]``, t_len, d_len < n;
  whatever each has not seen yet is fed at its next forward ("catch-up" tokens). The first
  iteration's catch-up is the prompt itself, so prefill and the first step share one forward.
- k = 0 is a plain decoding step: the target scores one position and the draft does nothing
  (it catches up in one forward when drafting resumes).

One iteration:
1. Draft k tokens autoregressively from the draft's cache (sampling from q, or argmax).
2. Score catch-up + k draft tokens in one target forward → p at the k+1 positions.
3. Verify: accepted + one recovered/bonus token (``verify.py``).
4. One host sync: the accepted count, the next token and the draft tokens come back together.
5. Emit tokens, stopping exactly where ``generate`` would (max_new_tokens, EOS, criteria).
6. Crop both caches to what was kept.

The draft scores its last proposal without a forward of its own: when all k are accepted, that
proposal and the bonus token are fed together at the start of the next iteration (a 2-token
forward costs about what a 1-token one does), which keeps the caches in sync and yields the
draft's distribution at the bonus position one iteration later.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field

import torch

from autospec.policies.base import Context, Outcome, Policy
from autospec.sampling import (
    SamplingConfig,
    block_presence,
    logits_to_probs,
    process_logits,
    sample,
    seen_tokens,
)
from autospec.verify import greedy_verify, rejection_sample

log = logging.getLogger(__name__)

__all__ = ["LoopStats", "LoopResult", "speculative_generate", "new_cache"]


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
    draft_s: float = 0.0  # the other draft forwards (one token each, or two after a bonus)
    draft_forwards: int = 0
    target_s_by_n: dict[int, list[float]] = field(default_factory=dict)  # scored tokens → times
    wall_s: float = 0.0
    stop_reason: str = ""

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


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


class _Forward:
    """Calls a causal LM with its cache, whatever the installed transformers names things."""

    def __init__(self, model):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.has_keep = "logits_to_keep" in params

    def __call__(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        kwargs = {self.cache_kw: cache, "use_cache": True}
        if self.has_keep:
            kwargs["logits_to_keep"] = keep
        logits = self.model(input_ids=ids, **kwargs).logits
        return logits[:, -keep:]  # [1, keep, V]


def _crop(cache, keep: int) -> None:
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)  # negative: remove that many tokens (every transformers 5.x)


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


def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,  # [1, L]
    *,
    sampling: SamplingConfig,
    policy: Policy,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    eos_token_ids: tuple[int, ...] = (),
    stopping_criteria=None,
    streamer=None,
    generator: torch.Generator | None = None,
    category: str = "default",
    k_max: int = 16,
    target_context: int | None = None,
    draft_context: int | None = None,
    output_scores: bool = False,
    output_logits: bool = False,
    time_forwards: bool = True,
) -> LoopResult:
    """Generate exactly as ``target.generate`` would, speculating with ``draft``."""
    t_start = time.perf_counter()
    device = input_ids.device
    L = input_ids.shape[1]
    vocab = target.get_output_embeddings().weight.shape[0]
    greedy = not sampling.do_sample
    stats = LoopStats(prompt_tokens=L)
    scores_out: list[torch.Tensor] | None = [] if output_scores else None
    logits_out: list[torch.Tensor] | None = [] if output_logits else None

    buf = torch.empty(1, L + max_new_tokens + k_max + 1, dtype=torch.long, device=device)
    buf[:, :L] = input_ids
    n = L
    t_fwd, d_fwd = _Forward(target), _Forward(draft)
    t_cache, d_cache = new_cache(target), new_cache(draft)
    t_len = d_len = 0
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device) if eos_token_ids else None
    eos_set = set(eos_token_ids)
    # tokens seen so far, for the repetition penalty (kept incrementally, never rescanned)
    seen = None
    if sampling.uses_presence:
        seen = seen_tokens(input_ids, vocab)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def banned_at(first_gen: int, npos: int) -> torch.Tensor | None:
        # EOS is suppressed at positions whose generated count is still below min_new_tokens
        if eos is None or first_gen >= min_new_tokens:
            return None
        rows = torch.arange(first_gen, first_gen + npos, device=device) < min_new_tokens
        mask = torch.zeros(npos, vocab, dtype=torch.bool, device=device)
        mask[:, eos] = rows[:, None]
        return mask

    def process(raw: torch.Tensor, first_gen: int, base_seen, block=None) -> torch.Tensor:
        """raw [1, npos, V] → processed scores; position j has seen base_seen + block[:, :j]."""
        raw = _fit_vocab(raw, vocab)
        npos = raw.shape[1]
        pos_seen = None if base_seen is None else block_presence(base_seen, block, npos)
        return process_logits(raw, sampling, seen=pos_seen, banned=banned_at(first_gen, npos))

    finished = False
    with torch.inference_mode():
        while not finished:
            generated = n - L
            remaining = max_new_tokens - generated
            ctx = Context(category=category, k_max=k_max, generated=generated, remaining=remaining)
            k_req = policy.choose(ctx)
            # every iteration emits at least one token: never draft past what can be kept
            k = max(0, min(int(k_req), k_max, remaining - 1))
            if target_context is not None:
                k = min(k, target_context - n)
            if draft_context is not None:
                k = min(k, draft_context - n + 1)
            k = max(k, 0)

            # 1. Draft k tokens
            d_time = 0.0
            q_list: list[torch.Tensor] = []
            d_toks = torch.empty(1, k, dtype=torch.long, device=device)
            if k > 0:
                t0 = time.perf_counter()
                feed = buf[:, d_len:n]
                catch_up = feed.shape[1] > 2  # the prompt, or tokens decoded while k was 0
                d_seen = seen.clone() if seen is not None else None
                for i in range(k):
                    raw = d_fwd(feed, d_cache, 1)  # [1, 1, V]
                    if i == 0 and catch_up:
                        t_catch = time.perf_counter() - t0
                    s = process(raw, generated + i, d_seen)
                    if greedy:
                        tok = s[:, 0].argmax(dim=-1)  # [1]
                    else:
                        q = logits_to_probs(s, sampling)  # [1, 1, V]
                        q_list.append(q)
                        tok = sample(q[:, 0], generator)  # [1]
                    d_toks[:, i] = tok
                    if d_seen is not None:
                        d_seen[0, tok] = True
                    feed = d_toks[:, i : i + 1]
                d_len = n + k - 1
                d_time = time.perf_counter() - t0
                # T_d is the cost of one proposed token: catch-up forwards are kept apart
                if catch_up:
                    stats.draft_prefill_s += t_catch
                stats.draft_forwards += k - catch_up
                stats.draft_s += d_time - (t_catch if catch_up else 0.0)

            # 2. Score catch-up + drafts in one target forward
            t0 = time.perf_counter()
            feed_t = torch.cat([buf[:, t_len:n], d_toks], dim=1)
            raw_t = t_fwd(feed_t, t_cache, k + 1)  # [1, k+1, V]
            s_t = process(raw_t, generated, seen, d_toks)  # [1, k+1, V]

            # 3. Verify
            if greedy:
                num_acc, nxt = greedy_verify(s_t.argmax(dim=-1), d_toks)
            else:
                p = logits_to_probs(s_t, sampling)
                q = torch.cat(q_list, dim=1) if k > 0 else p[:, :0]
                num_acc, nxt = rejection_sample(p, q, d_toks, generator=generator)
            t_len = n + k

            # 4. The iteration's one host sync
            vals = torch.cat([num_acc, nxt, d_toks[0]]).tolist()
            t_time = time.perf_counter() - t0
            if time_forwards:
                if stats.iterations == 0:
                    stats.prefill_s = t_time
                else:
                    stats.target_s_by_n.setdefault(k + 1, []).append(t_time)
            m, nxt_id, proposed = vals[0], vals[1], vals[2:]

            # 5. Emit, stopping where generate would
            new = proposed[:m] + [nxt_id]
            buf[:, n : n + m] = d_toks[:, :m]  # device-side copies: no host round trip
            buf[:, n + m] = nxt
            emitted = 0
            for tok in new:
                emitted += 1
                if tok in eos_set:
                    finished, stats.stop_reason = True, "eos"
                    break
                if stopping_criteria is not None and _criteria_hit(
                    stopping_criteria, buf[:, : n + emitted], s_t[:, emitted - 1]
                ):
                    finished, stats.stop_reason = True, "stopping_criteria"
                    break
            if output_scores:
                scores_out.extend(s_t[:, j].clone() for j in range(emitted))
            if output_logits:
                logits_out.extend(raw_t[:, j].float().clone() for j in range(emitted))
            if seen is not None:
                seen[0, buf[0, n : n + emitted]] = True
            if streamer is not None:
                streamer.put(torch.tensor(new[:emitted]))
            n += emitted
            if n - L >= max_new_tokens and not finished:
                finished, stats.stop_reason = True, "max_new_tokens"

            stats.iterations += 1
            stats.k_schedule.append(k)
            if k > 0:
                stats.drafts += 1
                stats.drafted += k
                stats.accepted += m
                _bump(stats.drafted_per_position, k)
                _bump(stats.accepted_per_position, m)
            policy.update(ctx, k, Outcome(drafted=k, accepted=m, draft_time_s=d_time,
                                          target_time_s=t_time))

            # 6. Keep only what was kept in both caches
            if not finished:
                _crop(t_cache, n - 1)
                t_len = n - 1
                if d_len > n - 1:
                    _crop(d_cache, n - 1)
                    d_len = n - 1

    if streamer is not None:
        streamer.end()
    stats.new_tokens = n - L
    stats.wall_s = time.perf_counter() - t_start
    return LoopResult(sequences=buf[:, :n].clone(), stats=stats, scores=scores_out,
                      logits=logits_out)


def _bump(counts: list[int], upto: int) -> None:
    """counts[i] += 1 for i < upto, growing the list as needed."""
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


def _criteria_hit(criteria, ids: torch.Tensor, scores: torch.Tensor) -> bool:
    hit = criteria(ids, scores)
    return bool(hit.any()) if isinstance(hit, torch.Tensor) else bool(hit)
