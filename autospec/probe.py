"""The hardware probe: is verification memory-bandwidth bound on this machine, and up to
which batch size?

Measures the target's cost to score n tokens per row, T_t(B, n), on a cache of ``context``
tokens per row, for each batch size B in ``batches`` and n = 1 … max_n; the draft's
one-token step T_d(B); and the achieved memory bandwidth of the target's one-token step at
batch 1 (weights + KV read ÷ time) against the device's peak. Where T_t(B, n) stays near
T_t(B, 1), scoring k+1 tokens per row costs what scoring one does and speculation can pay at
that batch size; where it grows linearly, verification is compute bound and it cannot.

The context is prefilled once, for one row; batch B runs on that cache repeated B times
along the batch dimension (the rows are identical, which changes nothing in the arithmetic),
so probing B = 32 costs no 32-row prefill. Every timed forward is cropped back to the context.
Batch sizes grow until one runs out of device memory (logged; the grid keeps those measured)
or the ``max_seconds`` budget would be overrun. Above ``dense_up_to`` rows only the n in
``SPARSE_N`` are measured: n = 1 … 9 (what the loop scores with k ≤ 8) and 12, 16.

What is timed is the loop's own step, so that probe and live T_t and T_d measure the same
thing: T_t(n) is the target's forward of n tokens, its logits processing (``process_logits``
with the request's ``SamplingConfig``), the greedy choice or the probabilities, and the
verification of the n − 1 drafted tokens (``greedy_verify`` / ``rejection_sample``) — from the
clock mark before the forward to the one after verification, as ``loop._Run.step`` marks
them; T_d is one draft forward with the same processing, the token choice and the draft's
confidence (its top probability), as ``draft_block`` times one proposal. Batch 1 runs
through the runner the loop would open (``runners.open_runner``: eager, or the static cache
with or without CUDA graphs), and the result names that ``path``; the store keeps costs per
path. Batch sizes above 1 are eager (the batched loop's path), so a static probe measures
batch 1 only.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from autospec.engine.runners import (
    Forward,
    crop_cache,
    new_cache,
    open_runner,
    path_name,
    resolve_graphs,
)
from autospec.engine.sampling import (
    SamplingConfig,
    block_presence,
    logits_to_probs,
    process_logits,
    sample,
    seen_tokens,
)
from autospec.engine.timing import Clock
from autospec.engine.verify import greedy_verify, rejection_sample
from autospec.telemetry import (
    hardware_name,
    kv_bytes_per_token,
    param_bytes,
    peak_bandwidth,
    raise_peak,
)

log = logging.getLogger(__name__)

__all__ = ["ProbeResult", "probe"]

MEMORY_BOUND_RATIO = 1.25  # T_t(n) / T_t(1) up to which we call scoring n tokens "free"
# n measured per row at batch sizes above ``dense_up_to``: the loop's k + 1 for k ≤ 8, and two
# points to extend the curve
SPARSE_N = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)
# tokens the draft model takes in at once in the catch-ups timed (its forward over what it
# has not seen: the prompt at its first block, a stretch decoded at k = 0 since): the points
# of the line C(g) = a + b·g a store with nothing logged yet prices its first catch-up by
CATCH_UP_SIZES = (8, 32, 128)


@dataclass
class ProbeResult:
    hardware: str
    dtype: str
    context: int
    target_s_by_n: dict[int, float]  # median seconds to score n tokens
    draft_s: float | None  # T_d: median seconds of the draft's one-token step
    target_param_bytes: int
    kv_bytes: int  # KV bytes read by a step at this context
    achieved_bytes_per_s: float  # (weights + KV) / T_t(1)
    peak_bytes_per_s: float | None
    threads: int
    # the batch dimension: B → n → median seconds of a forward scoring n tokens in each of B
    # rows (batch 1 is target_s_by_n), and B → the draft's one-token step at batch B
    grid: dict[int, dict[int, float]] = field(default_factory=dict)
    draft_grid: dict[int, float] = field(default_factory=dict)
    grid_note: str = ""  # why the grid stops short of the batch sizes asked for, if it does
    path: str = "eager"  # the runners' execution path (``runners.path_name``) it timed
    greedy: bool = True  # the step timed: greedy choice, or sampling probabilities
    # the draft model's catch-up at batch 1: (tokens taken in, median seconds of the forward
    # over them and its first proposal), at CATCH_UP_SIZES; empty without a draft model
    draft_catch_up: list[tuple[int, float]] = field(default_factory=list)

    @property
    def catch_up_line(self) -> tuple[float, float] | None:
        """(a, b) of C(g) = a + b·g fitted to ``draft_catch_up`` (as the live fit), or None."""
        from autospec.costs.rules import catch_up_line, catch_up_sums

        return catch_up_line(catch_up_sums(self.draft_catch_up)) if self.draft_catch_up else None

    @property
    def utilisation(self) -> float | None:
        return self.achieved_bytes_per_s / self.peak_bytes_per_s if self.peak_bytes_per_s else None

    @property
    def relative_cost(self) -> dict[int, float]:
        t1 = self.target_s_by_n[1]
        return {n: t / t1 for n, t in self.target_s_by_n.items()}

    @property
    def memory_bound_up_to(self) -> int:
        """The largest n whose cost stays within MEMORY_BOUND_RATIO of scoring one token."""
        ok = [n for n, r in self.relative_cost.items() if r <= MEMORY_BOUND_RATIO]
        return max(ok) if ok else 1

    @property
    def slope(self) -> float:
        """Least-squares growth of T_t(n)/T_t(1) per extra scored token (0: flat)."""
        pts = list(self.relative_cost.items())
        if len(pts) < 2:
            return 0.0
        mx = statistics.fmean(n for n, _ in pts)
        my = statistics.fmean(r for _, r in pts)
        return (sum((n - mx) * (r - my) for n, r in pts)
                / sum((n - mx) ** 2 for n, _ in pts))

    @property
    def draft_ratio(self) -> float | None:
        """c = T_d / T_t(1): acceptance must beat this for speculation to have a chance."""
        return self.draft_s / self.target_s_by_n[1] if self.draft_s else None

    def verdict(self) -> str:
        upto = self.memory_bound_up_to
        slope = self.slope
        if upto >= 4:
            head = f"verification is memory-bandwidth bound up to n = {upto} scored tokens"
        else:
            head = (f"verification is compute bound: each extra scored token adds "
                    f"{slope:.0%} of a one-token step")
        c = self.draft_ratio
        tail = f"; the draft costs c = {c:.2f} of a target step" if c is not None else ""
        return head + tail

    def batch_ratios(self, batch: int) -> dict[int, float]:
        """T_t(B, n) / T_t(B, 1) at batch size ``batch``, for the n measured there."""
        row = self.grid.get(batch, {})
        t1 = row.get(1)
        return {n: t / t1 for n, t in row.items()} if t1 else {}

    def memory_bound_batch(self, n: int = 4, ratio: float = MEMORY_BOUND_RATIO) -> int | None:
        """The largest batch size up to which scoring ``n`` tokens per row still costs at
        most ``ratio`` × scoring one (verification ~free): the last B before the first
        measured B where it does not. None if it is not even at the smallest B measured."""
        best = None
        for b in sorted(self.grid):
            r = self.batch_ratios(b).get(n)
            if r is None:
                continue
            if r > ratio:
                break
            best = b
        return best

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(utilisation=self.utilisation, memory_bound_up_to=self.memory_bound_up_to,
                 slope=self.slope, memory_bound_batch=self.memory_bound_batch(),
                 draft_ratio=self.draft_ratio, verdict=self.verdict())
        return d


def _median_time(fn, clock: Clock, repeats: int, after=None) -> float:
    """Median seconds of ``fn()`` between two clock marks; ``after()`` (e.g. a crop) runs
    untimed after each, as the loop crops after its iteration's sync."""
    times = []
    for _ in range(repeats):
        a = clock.mark()
        fn()
        b = clock.mark()
        if clock.cuda:
            torch.cuda.synchronize()
        times.append(clock.seconds(a, b))
        if after is not None:
            after()
    return statistics.median(times)


class _Step:
    """The loop's work after a forward, on its logits: what T_t and T_d include besides the
    model. ``verify``: the target's step on raw logits [B, n, V] scoring n − 1 drafts;
    ``propose``: the draft's step on raw logits [B, 1, V]."""

    def __init__(self, sampling: SamplingConfig, vocab: int, prompt: torch.Tensor):
        self.sampling, self.vocab = sampling, vocab
        self.greedy = not sampling.do_sample
        self.generator = torch.Generator(device=prompt.device).manual_seed(0)
        self.seen = seen_tokens(prompt, vocab) if sampling.uses_presence else None

    def _seen(self, batch: int, drafts: torch.Tensor | None, npos: int):
        if self.seen is None:
            return None
        return block_presence(self.seen.expand(batch, -1), drafts, npos)

    def verify(self, raw: torch.Tensor, drafts: torch.Tensor):
        from autospec.engine.batch import fit_vocab as _fit_vocab

        k = drafts.shape[1]
        s = process_logits(_fit_vocab(raw, self.vocab), self.sampling,
                           seen=self._seen(raw.shape[0], drafts, k + 1))
        if self.greedy:
            tgt = s.argmax(dim=-1)
            num, nxt = greedy_verify(tgt, drafts)
            return num, nxt, drafts == tgt[:, :k]
        p = logits_to_probs(s, self.sampling)
        q = p[:, :k]  # the draft's q stands in: same shapes, same arithmetic
        num, nxt = rejection_sample(p, q, drafts, generator=self.generator)
        return num, nxt, torch.minimum(p[:, :k], q).sum(-1)

    def propose(self, raw: torch.Tensor):
        from autospec.engine.batch import fit_vocab as _fit_vocab

        s = process_logits(_fit_vocab(raw, self.vocab), self.sampling,
                           seen=self._seen(raw.shape[0], None, 1))
        if self.greedy:
            return s[:, 0].argmax(dim=-1), s[:, 0].softmax(dim=-1).amax(dim=-1)
        q = logits_to_probs(s, self.sampling)
        return sample(q[:, 0], self.generator), q[:, 0].amax(dim=-1)


class _OnCache:
    """A runner over a given cache (the grid's replicated caches at batch > 1)."""

    path = "eager"

    def __init__(self, fwd: Forward, cache):
        self.fwd, self.cache = fwd, cache

    def run(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        return self.fwd(ids, self.cache, keep)

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg
                                              or "can't allocate memory" in msg
                                              or "failed to allocate" in msg)


def _replicate(cache, batch: int):
    """A copy of a one-row cache with that row repeated ``batch`` times."""
    out = copy.deepcopy(cache)
    if batch > 1:
        out.batch_repeat_interleave(batch)
    return out


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _curve(run, step: _Step, extra: torch.Tensor, context: int, ns, clock: Clock,
           repeats: int, tick) -> dict[int, float]:
    """Median seconds of the loop's verification step scoring n tokens (``extra[:, :n]``,
    every row; the last n − 1 of them as drafts) on ``run``'s cache, per n. Rounds over every
    n, so that a burst of machine noise spreads over the curve instead of bending one stretch
    of it; one untimed round first (lazy setup; graph captures on the static path)."""
    def score(n: int):
        step.verify(run.run(extra[:, :n], n), extra[:, 1:n])

    def back():
        run.crop(context)

    for n in ns:  # warm-up
        score(n)
        back()
    times: dict[int, list[float]] = {n: [] for n in ns}
    for _ in range(repeats):
        for n in times:
            times[n].append(_median_time(lambda n=n: score(n), clock, 1, back))
            tick()
    return {n: statistics.median(ts) for n, ts in times.items()}


def _draft_step(run, step: _Step, extra: torch.Tensor, context: int, clock: Clock,
                repeats: int, width: int = 1) -> float:
    """Median seconds of one proposal: the draft's forward over ``width`` new tokens (1: a
    proposal; more: a catch-up over tokens it has not seen) and its step from the last."""
    def propose():
        step.propose(run.run(extra[:, :width], 1))

    def back():
        run.crop(context)

    propose()  # warm-up
    back()
    return _median_time(propose, clock, repeats, back)


@torch.inference_mode()
def probe(target, draft=None, *, context: int = 200, max_n: int = 16, repeats: int = 5,
          cache_dir=None, progress=None, batches=(1,), max_seconds: float | None = None,
          dense_up_to: int = 8, static_cache: bool = False, cuda_graphs="auto",
          sampling: SamplingConfig | None = None) -> ProbeResult:
    """Measure the cost grid; ``progress(i, total)`` is called as points complete.

    ``batches``: the batch sizes B to measure (1 is always measured: the bandwidth figures
    and ``target_s_by_n`` are batch 1's). Above ``dense_up_to`` rows only ``SPARSE_N`` (≤
    max_n) is measured. ``max_seconds``: stop adding batch sizes once the next one (estimated
    from the last, scaled by B) would overrun this budget. ``static_cache``, ``cuda_graphs``:
    the runner batch 1 runs on, as ``wrap`` takes them (the result's ``path``); the static
    path measures batch 1 only. ``sampling``: the step timed (default greedy)."""
    device = next(target.parameters()).device
    graphs = resolve_graphs(cuda_graphs, device) if static_cache else None
    path = path_name(bool(static_cache), graphs)
    if static_cache and any(int(b) > 1 for b in batches):
        raise ValueError("batch sizes above 1 run eager forwards (the batched loop's path): "
                         "probe them without static_cache")
    sampling = sampling or SamplingConfig()
    clock = Clock(device)
    vocab = min(target.config.get_text_config().vocab_size, 32000)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
    extra = torch.randint(0, vocab, (1, max_n), generator=g).to(device)
    unseen = torch.randint(0, vocab, (1, max(CATCH_UP_SIZES)), generator=g).to(device)
    step = _Step(sampling, target.get_output_embeddings().weight.shape[0], prompt)
    sizes = sorted({1, *(int(b) for b in batches)})
    if sizes[0] < 1:
        raise ValueError(f"batch sizes must be positive, got {list(batches)}")

    def ns_at(b: int) -> list[int]:
        if b == 1 or b <= dense_up_to:
            return list(range(1, max_n + 1))
        return [n for n in SPARSE_N if n <= max_n]

    total = (sum(len(ns_at(b)) * repeats + (draft is not None) for b in sizes)
             + (draft is not None) * len(CATCH_UP_SIZES))
    done = 0

    def tick(step: int = 1) -> None:
        nonlocal done
        done += step
        if progress:
            progress(done, total)

    # batch 1 through the runners the loop opens; the caches hold the context
    started = time.perf_counter()
    need = context + max_n + 1
    t_run = open_runner(target, need, static=bool(static_cache), graphs=graphs)
    d_run = None
    try:
        if draft is not None:
            d_run = open_runner(draft, max(need, context + max(CATCH_UP_SIZES) + 1),
                                static=bool(static_cache), graphs=graphs)
        if t_run.path != path or (d_run is not None and d_run.path != path):
            log.warning("probe: the %s path was asked for but the runners run %s: the "
                        "probe is stored under the latter", path,
                        "/".join(sorted({t_run.path, *([d_run.path] if d_run else [])})))
        t_run.run(prompt, 1)
        if d_run is not None:
            d_run.run(prompt, 1)
        grid = {1: _curve(t_run, step, extra, context, ns_at(1), clock, repeats, tick)}
        draft_grid: dict[int, float] = {}
        catch_ups: list[tuple[int, float]] = []
        if d_run is not None:
            draft_grid[1] = _draft_step(d_run, step, extra, context, clock, repeats)
            tick()
            # the loop's catch-up: one forward over g unseen tokens, its first proposal
            catch_ups = [(g, _draft_step(d_run, step, unseen, context, clock, repeats, g))
                         for g in CATCH_UP_SIZES]
            tick(len(CATCH_UP_SIZES))
        paths = {t_run.path, *([d_run.path] if d_run else [])}
        path = paths.pop() if len(paths) == 1 else f"{t_run.path}/{d_run.path}"
    finally:
        t_run.release()
        if d_run is not None:
            d_run.release()

    fwd = base = dfwd = dbase = None
    if len(sizes) > 1:  # the grid: one prefilled row repeated B times (eager)
        fwd, base = Forward(target), new_cache(target)
        fwd(prompt, base, 1)
        if draft is not None:
            dfwd, dbase = Forward(draft), new_cache(draft)
            dfwd(prompt, dbase, 1)

    note = ""
    last = (1, time.perf_counter() - started)  # (B, seconds it took)
    for b in sizes[1:]:
        if max_seconds is not None:
            spent = time.perf_counter() - started
            estimate = last[1] * b / last[0]
            if spent + estimate > max_seconds:
                note = (f"stopped before B = {b}: ~{estimate:.0f} s more would overrun the "
                        f"{max_seconds:g} s budget")
                log.info("probe: %s", note)
                break
        t0 = time.perf_counter()
        cache = dcache = None
        try:
            cache = _replicate(base, b)
            grid[b] = _curve(_OnCache(fwd, cache), step, extra.expand(b, -1), context,
                             ns_at(b), clock, repeats, tick)
            if draft is not None:
                dcache = _replicate(dbase, b)
                draft_grid[b] = _draft_step(_OnCache(dfwd, dcache), step,
                                            extra.expand(b, -1), context, clock, repeats)
                tick()
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            if not _is_oom(exc):
                raise
            grid.pop(b, None)
            note = f"out of memory at B = {b}; the grid stops at B = {max(grid)}"
            log.warning("probe: %s (%s)", note, str(exc).splitlines()[0])
            break
        finally:
            del cache, dcache
            _release(device)
        last = (b, time.perf_counter() - t0)

    curve = grid[1]
    draft_s = draft_grid.get(1)
    weights = param_bytes(target)
    kv = kv_bytes_per_token(target) * context
    achieved = (weights + kv) / curve[1]
    peak = raise_peak(device, cache_dir, peak_bandwidth(device, cache_dir), achieved,
                      weights + kv)
    return ProbeResult(
        hardware=hardware_name(device), dtype=str(next(target.parameters()).dtype).split(".")[-1],
        context=context, target_s_by_n=curve, draft_s=draft_s, target_param_bytes=weights,
        kv_bytes=kv, achieved_bytes_per_s=achieved, peak_bytes_per_s=peak,
        threads=torch.get_num_threads(), grid=grid, draft_grid=draft_grid, grid_note=note,
        path=path, greedy=not sampling.do_sample, draft_catch_up=catch_ups)
