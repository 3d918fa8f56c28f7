"""Engine telemetry into the store: a vLLM or SGLang metrics scrape (Prometheus text exposition
format) becomes one request-less record of a category's statistics — its spec-decode counters
(drafts, draft tokens, accepted tokens, accepted tokens per position) — so that ``report`` and
``export`` work for traffic an engine served. No traces: replay and tuning need autospec's own
requests.

vLLM counts drafts at a fixed k (``num_speculative_tokens``), so the draft tokens proposed at
each position are taken as the number of drafts (positions 0 … K−1 from the per-position
counter's ``position`` labels); drafts that vLLM truncated (near the length limit) make that a
slight over-count. The counters are cumulative since the engine started: ingesting the same
engine twice counts its traffic twice (pass ``baseline``: an earlier scrape of the same engine,
to ingest only the traffic between the two).

autospec's own exporters (``autospec.fleet.metrics``) use the same names, so their scrapes ingest
the same way.

vLLM's own clock is read too (``engine_step``): over a window between two scrapes that ran one
request at a time, its requests' decode seconds (``vllm:request_decode_time_seconds``) over its
decode steps (``vllm:iteration_tokens_total``'s count less one prefill step per request) is its
seconds per step at the window's k — drafting included, k = 0 for a plain server's window —
which ``autospec ingest`` keeps for the pair and the draft-model export lists (and prices k
by where it has no custom_class steps: ``fleet.export._engine_draft_plan``).

SGLang (``sglang:`` metrics, sglang 0.5.23 ``sglang/srt/observability/metrics_collector.py``)
counts less: its acceptance metrics (``sglang:spec_accept_length``, ``sglang:spec_accept_rate``)
are gauges over the last logging interval, not counters, so they cannot be summed or
differenced and are not read. What it counts cumulatively is ``sglang:spec_verify_calls_total``
(verification forwards, summed per finished request), ``sglang:generation_tokens_total``,
``sglang:num_requests_total`` and ``sglang:prompt_tokens_total``; the gauge
``sglang:spec_num_draft_tokens`` gives the draft length in force (k + 1, the verified token
included; ``k`` where a scrape lacks it). From those:

- drafts = verification calls; draft tokens = drafts × k (SGLang drafts a fixed k; adaptive
  speculation that changed k between scrapes is refused where the gauge shows it);
- accepted = generation tokens − verification calls − requests: each request's first token
  comes from the prefill and each verification emits its accepted tokens plus one
  (SGLang's own per-request ``spec_accept_length`` is completion tokens / verification calls).
  Tokens cut at a stop string or the length limit make it a slight under-count;
- per-position acceptance is unknown: SGLang does not count it, so the record carries none
  (the report's per-position view and the cost model's k then rest on other records of the
  category, or say they have none) — nothing is spread over positions by assumption.

What is refused, with one line naming the sample (``IngestError``), nothing written: a scrape
larger than ``MAX_SCRAPE_BYTES`` (read no further than that); a series that appears twice (the
text format allows each name and label set once: two would be summed into a count no engine
made); a counter value that is not a whole number ≥ 0 (NaN, ±Inf, a negative or fractional
count, one beyond 2^53); a ``model_name`` longer than ``MAX_NAME`` characters; a per-position
sample whose ``position`` label is negative, at or beyond ``MAX_POSITIONS`` (autospec's k
limit: no engine setting autospec exports drafts further), or beyond what the scrape's own
counters allow — every draft proposes at least one token, so the longest draft has at most
``draft tokens − drafts + 1`` tokens and a position past that was never drafted; and counters
that contradict each other (``check_counters``: more tokens accepted than drafted, a position
accepted more often than there were drafts or than the position before it, per-position
counts that do not sum to the accepted tokens). Scraped names in messages are cut short
(``autospec.textfmt.named``).
"""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from dataclasses import dataclass, field

from autospec.policies.base import K_LIMIT
from autospec.textfmt import clip, named

log = logging.getLogger(__name__)

__all__ = ["SpecCounters", "EngineStep", "engine_step", "parse_scrape", "read_scrape",
           "to_record", "check_counters", "IngestError", "MAX_SCRAPE_BYTES", "MAX_POSITIONS",
           "MAX_NAME", "ENGINES"]

# a vLLM /metrics page is tens of kB (a few MB with many models and histograms); past this it
# is not a scrape (or not one to read whole): refused, not read on
MAX_SCRAPE_BYTES = 32 * 1024 * 1024
# the largest count a float holds exactly (a counter's value beyond it is not a count)
MAX_COUNT = 2.0 ** 53
# draft positions a scrape may count (0 … MAX_POSITIONS − 1): autospec's one limit on k
MAX_POSITIONS = K_LIMIT
# the longest model_name label read (it names the pair's target in the store): a Hub id or a
# path is far shorter; past this it is not a model's name
MAX_NAME = 1024

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION = "vllm:generation_tokens"
PROMPT = "vllm:prompt_tokens"
# vLLM's own clock: the decode phase's seconds of finished requests (a histogram: its _sum
# and _count) and the engine's steps (the histogram of tokens per step: its _count)
DECODE_S = "vllm:request_decode_time_seconds_sum"
DECODED = "vllm:request_decode_time_seconds_count"
STEPS = "vllm:iteration_tokens_total_count"
TIMING = (DECODE_S, DECODED, STEPS)
# a window whose decode steps drafted more than this many times each ran more than one
# request at once: its seconds per step are not batch 1's
BATCH_ONE = 1.25

SGL_VERIFY = "sglang:spec_verify_calls"
SGL_GENERATION = "sglang:generation_tokens"
SGL_PROMPT = "sglang:prompt_tokens"
SGL_REQUESTS = "sglang:num_requests"
SGL_DRAFT_TOKENS = "sglang:spec_num_draft_tokens"  # a gauge: k + 1 in force

ENGINES = ("auto", "vllm", "sglang")


class IngestError(ValueError):
    """The scrape has no spec-decode counters for the model asked for (or is not a scrape)."""


@dataclass
class SpecCounters:
    model: str
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    # empty where the engine does not count per position (SGLang): unknown, not zero
    accepted_per_position: list[int] = field(default_factory=list)
    generation_tokens: int | None = None
    prompt_tokens: int | None = None
    engine: str = "vllm"
    k: int | None = None  # the fixed draft length (SGLang's), where the scrape states it
    requests: int | None = None  # finished requests (SGLang's)
    # vLLM's clock, where the scrape has it: seconds its finished requests spent decoding,
    # those requests, and the engine's steps (prefill included) — ``engine_step``
    decode_s: float | None = None
    decoded: int | None = None
    steps: int | None = None

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        """The traffic between ``earlier`` and this scrape (an engine restart resets the
        counters: then this scrape's counts are all new)."""
        if earlier.engine != self.engine:
            raise IngestError(f"the baseline is a {earlier.engine} scrape and this one a "
                              f"{self.engine} scrape: not the same engine")
        if self.k is not None and earlier.k is not None and self.k != earlier.k:
            raise IngestError(f"the draft length changed between the scrapes (k = {earlier.k}, "
                              f"then {self.k}): the draft tokens between them are unknown")
        if self.drafts < earlier.drafts or self.accepted < earlier.accepted:
            log.warning("autospec: the counters went down since the baseline scrape (the "
                        "engine restarted?): ingesting this scrape's counts whole")
            return self
        pos = [a - (earlier.accepted_per_position[i] if i < len(earlier.accepted_per_position)
                    else 0) for i, a in enumerate(self.accepted_per_position)]

        def sub(a, b):
            return None if a is None else a - (b or 0)
        return SpecCounters(self.model, self.drafts - earlier.drafts,
                            self.draft_tokens - earlier.draft_tokens,
                            self.accepted - earlier.accepted, pos,
                            sub(self.generation_tokens, earlier.generation_tokens),
                            sub(self.prompt_tokens, earlier.prompt_tokens), self.engine,
                            self.k, sub(self.requests, earlier.requests),
                            sub(self.decode_s, earlier.decode_s),
                            sub(self.decoded, earlier.decoded), sub(self.steps, earlier.steps))


@dataclass(frozen=True)
class EngineStep:
    """vLLM's own seconds per decode step over a scrape window that ran one request at a time
    at a fixed k (``engine_step``): a step scores k + 1 tokens and drafts the next k, the
    draft model's time inside it (k = 0: a plain step)."""

    k: int  # 0: plain decoding
    seconds: float  # the window's decode seconds
    steps: int  # its decode steps
    per_step: float  # drafts (plain: tokens) per decode step (1: one request at a time)

    @property
    def n(self) -> int:
        """Tokens a step scores (the store's key for it)."""
        return self.k + 1

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps


def engine_step(c: SpecCounters) -> tuple[EngineStep | None, str]:
    """vLLM's seconds per decode step at the window's k, from its own clock: the decode
    seconds of the requests that finished (``vllm:request_decode_time_seconds``: first token to
    last) over their decode steps (the engine's steps, ``vllm:iteration_tokens_total``'s count,
    less one prefill step per finished request). A window without drafts is plain decoding
    (k = 0), each decode step one token per request. (step, "") where the window allows it,
    else (None, why not): no clock in the scrape (SGLang, an older vLLM), no whole k (the
    drafts were not all k long), no request finished, or a window not of one request at a time
    — more than ``BATCH_ONE`` drafts (plain: tokens) per decode step, requests sharing the
    steps so that their decode seconds overlap, or fewer than 1 / ``BATCH_ONE``: requests still
    running at a scrape (a window should start and end idle)."""
    if c.engine != "vllm" or None in (c.decode_s, c.decoded, c.steps):
        return None, "the scrape has no vllm:request_decode_time_seconds / " \
                     "vllm:iteration_tokens_total (vLLM's own clock)"
    if c.drafts and c.draft_tokens % c.drafts:
        return None, (f"{c.draft_tokens} draft tokens in {c.drafts} drafts: not one fixed k, "
                      "so no step is at a known k")
    steps = c.steps - c.decoded
    if c.decoded <= 0 or steps <= 0 or c.decode_s <= 0:
        return None, "no finished request decoded in the window"
    if c.drafts:
        per_step, what = c.drafts / steps, "drafts"
    elif c.generation_tokens is not None:  # plain: a step decodes a token per request
        per_step, what = (c.generation_tokens - c.decoded) / steps, "tokens"
    else:
        return None, "a window without drafts needs vllm:generation_tokens_total"
    if per_step > BATCH_ONE:
        return None, (f"{per_step:.2f} {what} per decode step: requests ran together, so "
                      "their decode seconds overlap (scrape a window of one request at a time)")
    if per_step < 1 / BATCH_ONE:
        return None, (f"{per_step:.2f} {what} per decode step: steps without a draft, or "
                      "requests still running at a scrape (a window should start and end idle)")
    k = c.draft_tokens // c.drafts if c.drafts else 0
    return EngineStep(k, float(c.decode_s), steps, per_step), ""


def _base(name: str) -> str:
    for suffix in ("_total", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def parse_scrape(text: str, model: str | None = None,
                 labels: dict[str, str] | None = None, *, engine: str = "auto",
                 k: int | None = None) -> SpecCounters:
    """The spec-decode counters of one model in a scrape, summed over engines (and over any
    other labels, restricted to ``labels`` where given). ``model``: the ``model_name`` label;
    None — the scrape's only one. ``engine``: "vllm", "sglang" or "auto" (vLLM's counters
    where present, else SGLang's). ``k``: SGLang's draft length where the scrape has no
    ``sglang:spec_num_draft_tokens`` gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError and others on malformed input
        raise IngestError(f"not a Prometheus text exposition: {e}") from None
    wanted = {DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS, GENERATION, PROMPT, SGL_VERIFY,
              SGL_GENERATION, SGL_PROMPT, SGL_REQUESTS, SGL_DRAFT_TOKENS, *TIMING}
    samples = []
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for fam in families:
        for s in fam.samples:
            if s.name.endswith("_created") or _base(s.name) not in wanted:
                continue
            series = (s.name, tuple(sorted(s.labels.items())))
            if series in seen:
                raise IngestError(f"{_named(s)} appears twice in the scrape: the text format "
                                  "has each series once (nothing was written)")
            seen.add(series)
            if labels and any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            samples.append(s)
    if engine == "auto":
        engine = "sglang" if (not any(_base(s.name) == DRAFTS for s in samples)
                              and any(_base(s.name) == SGL_VERIFY for s in samples)) else "vllm"
    head = DRAFTS if engine == "vllm" else SGL_VERIFY
    models = sorted({s.labels.get("model_name", "") for s in samples if _base(s.name) == head})
    if not models and engine == "vllm":  # a plain server: its clock alone (``engine_step``)
        models = sorted({s.labels.get("model_name", "") for s in samples if s.name in TIMING})
    if not models:
        what = (f"no {DRAFTS} counter" if engine == "vllm" else f"no {SGL_VERIFY}_total counter")
        raise IngestError(f"{what} in the scrape (was speculative decoding on?"
                          + (" SGLang needs --enable-metrics" if engine == "sglang" else "")
                          + ")" + (f" with labels {_labels(labels)}" if labels else ""))
    if model is None:
        if len(models) > 1:
            raise IngestError(f"the scrape has {len(models)} models: choose one with --model "
                              f"({_models(models)})")
        model = models[0]
    elif model not in models:
        raise IngestError(f"no spec-decode counters for model {named(model)} in the scrape "
                          f"(it has {_models(models)})")
    if len(model) > MAX_NAME:
        raise IngestError(f"the scrape's model_name {named(model)} is {len(model)} characters "
                          f"long, more than the {MAX_NAME} a model's name may have (nothing "
                          "was written)")
    mine = [s for s in samples if s.labels.get("model_name", "") == model]
    for s in mine:
        if not (math.isfinite(s.value) and 0 <= s.value <= MAX_COUNT):
            raise IngestError(f"{_named(s)} has the value {s.value}: a counter is a finite "
                              "number ≥ 0 (the scrape is refused, nothing was written)")
        if s.value != math.floor(s.value) and s.name != DECODE_S:  # seconds need not be whole
            raise IngestError(f"{_named(s)} has the value {s.value}: a count is a whole "
                              "number (the scrape is refused, nothing was written)")
    if engine == "sglang":
        return _sglang(mine, model, k)
    return _vllm(mine, model)


def _vllm(samples, model: str) -> SpecCounters:
    out = SpecCounters(model)
    per_pos: dict[int, float] = {}
    gen = prompt = None
    for s in samples:
        base = _base(s.name)
        if base == DRAFTS:
            out.drafts += int(round(s.value))
        elif base == DRAFT_TOKENS:
            out.draft_tokens += int(round(s.value))
        elif base == ACCEPTED:
            out.accepted += int(round(s.value))
        elif base == PER_POS:
            try:
                pos = int(s.labels["position"])
            except (KeyError, ValueError):
                raise IngestError(f"{PER_POS} sample without an integer position label: "
                                  f"{s.labels}") from None
            if not 0 <= pos < MAX_POSITIONS:
                raise IngestError(f"{_named(s)}: position {pos} is outside 0..{MAX_POSITIONS - 1}"
                                  f" (autospec reads at most {MAX_POSITIONS} draft positions)")
            per_pos[pos] = per_pos.get(pos, 0) + s.value
        elif base == GENERATION:
            gen = (gen or 0) + int(round(s.value))
        elif base == PROMPT:
            prompt = (prompt or 0) + int(round(s.value))
        elif s.name == DECODE_S:
            out.decode_s = (out.decode_s or 0.0) + s.value
        elif s.name == DECODED:
            out.decoded = (out.decoded or 0) + int(round(s.value))
        elif s.name == STEPS:
            out.steps = (out.steps or 0) + int(round(s.value))
    width = max(per_pos) + 1 if per_pos else 0
    longest = out.draft_tokens - out.drafts + 1  # every draft proposes at least one token
    if 0 < out.drafts <= out.draft_tokens and width > longest:  # else check_counters says
        raise IngestError(
            f"{PER_POS} has position {width - 1}, but the scrape's {out.draft_tokens} draft "
            f"tokens in {out.drafts} drafts allow positions 0..{longest - 1} at most: the "
            "counters disagree (nothing was written)")
    out.accepted_per_position = [int(round(per_pos.get(i, 0))) for i in range(width)]
    out.generation_tokens, out.prompt_tokens = gen, prompt
    return check_counters(out)


def check_counters(c: SpecCounters) -> SpecCounters:
    """``c`` if its counters agree with each other, else IngestError saying where they do not:
    every count ≥ 0 (a difference from a baseline included), a draft proposes at least one
    token, no more tokens accepted than drafted, and per position (where the engine counts it):
    at most one accepted token per draft, no position accepted more often than the one before
    it (a draft's token is accepted only after every earlier one), the positions summing to
    the accepted tokens."""
    def disagree(what: str) -> IngestError:
        return IngestError(f"the counters disagree: {what} (nothing was written)")

    pos = c.accepted_per_position
    counts = {"drafts": c.drafts, "draft tokens": c.draft_tokens, "accepted tokens": c.accepted,
              **{f"position {i}": a for i, a in enumerate(pos)}}
    below = [name for name, v in counts.items() if v < 0]
    if below:
        raise disagree(f"{below[0]} is {counts[below[0]]} (the counters went down since the "
                       "baseline scrape?)")
    if c.drafts > c.draft_tokens:
        raise disagree(f"{c.drafts} drafts proposed {c.draft_tokens} draft tokens, and every "
                       "draft proposes at least one")
    if c.accepted > c.draft_tokens:
        raise disagree(f"{c.accepted} accepted tokens of {c.draft_tokens} draft tokens, an "
                       f"acceptance of {c.accepted / max(c.draft_tokens, 1):.0%}")
    for i, a in enumerate(pos):
        if a > c.drafts:
            raise disagree(f"position {i} counts {a} accepted tokens in {c.drafts} drafts, "
                           "at most one per draft")
        if i and a > pos[i - 1]:
            raise disagree(f"position {i} counts {a} accepted tokens, more than position "
                           f"{i - 1}'s {pos[i - 1]} (a draft's token is accepted only after "
                           "every earlier one)")
    if pos and sum(pos) != c.accepted:
        raise disagree(f"the accepted tokens per position sum to {sum(pos)}, the accepted "
                       f"tokens counter says {c.accepted}")
    return c


def _sglang(samples, model: str, k: int | None) -> SpecCounters:
    """SGLang's counters (see the module's docstring for what they allow)."""
    sums: dict[str, int] = {}
    gauge = set()
    for s in samples:
        base = _base(s.name)
        if base == SGL_DRAFT_TOKENS:
            gauge.add(int(round(s.value)))
        else:
            sums[base] = sums.get(base, 0) + int(round(s.value))
    gauge.discard(0)  # 0 until the scheduler's first decode log with speculation
    if len(gauge) > 1:
        raise IngestError(f"{SGL_DRAFT_TOKENS} differs between the scrape's samples "
                          f"({', '.join(map(str, sorted(gauge)))}): adaptive speculation or "
                          f"several configurations, the draft tokens are unknown")
    if gauge:
        stated = gauge.pop() - 1
        if k is not None and k != stated:
            raise IngestError(f"--k {k} disagrees with the scrape's {SGL_DRAFT_TOKENS} "
                              f"({stated + 1}, i.e. k = {stated})")
        k = stated
    if k is None or k < 1:
        raise IngestError(f"the scrape has no {SGL_DRAFT_TOKENS} gauge (an older SGLang, or "
                          "no decode logged yet): give the draft length with --k "
                          "(--speculative-num-steps of a chain)")
    if k > MAX_POSITIONS:
        raise IngestError(f"a draft length of {k} is beyond autospec's {MAX_POSITIONS}")
    missing = [n for n in (SGL_GENERATION, SGL_REQUESTS) if n not in sums]
    if missing:
        raise IngestError(f"the scrape has {SGL_VERIFY}_total but no "
                          f"{' or '.join(m + '_total' for m in missing)}: the accepted tokens "
                          "cannot be counted")
    drafts, gen, req = sums.get(SGL_VERIFY, 0), sums[SGL_GENERATION], sums[SGL_REQUESTS]
    accepted = gen - drafts - req
    if accepted < 0 or accepted > drafts * k:
        raise IngestError(f"the counters disagree: {gen} generation tokens, {drafts} "
                          f"verification calls and {req} requests leave {accepted} accepted "
                          f"tokens, outside 0..{drafts * k} for k = {k} (nothing was written)")
    return SpecCounters(model, drafts, drafts * k, accepted, [], gen, sums.get(SGL_PROMPT),
                        engine="sglang", k=k, requests=req)


def _named(sample) -> str:
    """A sample as the scrape writes it, ``name{label="value",…}``, each value cut short."""
    return f"{clip(sample.name, 80)}{{{_labels(sample.labels)}}}"


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{clip(k, 40)}="{clip(v, 60)}"' for k, v in sorted(labels.items())[:8])


def _models(models: list[str]) -> str:
    shown = ", ".join(named(m) for m in models[:10])
    return shown + (f" and {len(models) - 10} more" if len(models) > 10 else "")


def read_scrape(source: str, timeout: float = 10.0, limit: int = MAX_SCRAPE_BYTES) -> str:
    """A scrape's text from a file or an http(s) URL, read up to ``limit`` bytes: a longer
    one (``/dev/zero``, a log file given by mistake) is refused with IngestError, having read
    ``limit`` + 1 bytes. A file must be UTF-8 (UnicodeDecodeError otherwise); an HTTP body's
    undecodable bytes are replaced."""
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=timeout) as r:
            data = r.read(limit + 1)
        errors = "replace"
    else:
        with open(source, "rb") as f:
            data = f.read(limit + 1)
        errors = "strict"
    if len(data) > limit:
        raise IngestError(f"{source} is larger than {limit / 2**20:g} MiB, the most a scrape "
                          "may hold: not a metrics page (vLLM's is a few hundred kB)")
    return data.decode("utf-8", errors)


def to_record(c: SpecCounters, *, category: str, target: str | None = None,
              draft: str = "unknown", dtype: str = "unknown", hardware: str = "unknown",
              engine: str | None = None, created_at: float | None = None):
    """One ``RequestRecord`` carrying the counters (no trace, no timings)."""
    from autospec.engine.proposers import model_proposer
    from autospec.store.record import TRACE_GREEDY, PairInfo, ProposerRecord, RequestRecord

    if c.drafts <= 0:
        raise IngestError("the scrape counts no drafts for this model: nothing to ingest (a "
                          "plain vLLM server's window, with --baseline, records its step "
                          "time alone)")
    check_counters(c)  # again: a difference from a baseline may not agree
    width = len(c.accepted_per_position)
    return RequestRecord(
        pair=PairInfo(target=target or c.model, draft=draft, dtype=dtype, hardware=hardware),
        category=category, policy=f"{engine or c.engine} (ingested)", greedy=True,
        prompt_tokens=c.prompt_tokens or 0,
        new_tokens=c.generation_tokens if c.generation_tokens is not None
        else c.drafts + c.accepted,
        iterations=c.drafts,
        proposers={model_proposer(): ProposerRecord(
            kind="model", blocks=c.drafts, proposed=c.draft_tokens, accepted=c.accepted,
            accepted_per_position=list(c.accepted_per_position),
            proposed_per_position=[c.drafts] * width, trace=None)},  # none: a scrape
        k_schedule=b"", accepted_schedule=b"", wall_s=0.0, prefill_s=0.0, draft_s=0.0,
        draft_forwards=0, target_s_by_n={}, trace_kind=TRACE_GREEDY,
        stop_reason="ingested", created_at=created_at if created_at is not None else time.time())
