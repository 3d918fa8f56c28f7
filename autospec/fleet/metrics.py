"""Prometheus metrics, named and shaped after vLLM's speculative-decoding metrics.

The four counters vLLM v1 exports for speculative decoding keep its names, so dashboards
built for vLLM read autospec too (vllm-project/vllm, ``vllm/v1/spec_decode/metrics.py``,
``SpecDecodingProm``; prometheus_client appends ``_total`` to a counter's name):

- ``vllm:spec_decode_num_drafts``: iterations that proposed at least one draft token
- ``vllm:spec_decode_num_draft_tokens``: draft tokens proposed
- ``vllm:spec_decode_num_accepted_tokens``: draft tokens accepted
- ``vllm:spec_decode_num_accepted_tokens_per_pos``: accepted tokens by draft position
  (label ``position``, from 0)

vLLM labels them ``model_name`` (and ``engine``); autospec labels them ``model_name`` (the
target), ``category``, ``pair`` (``target/draft``, short names) and ``proposer`` (``draft``;
the acceptance counters also under each lookup proposer's name — ``ngram``, ``suffix`` — for
the blocks it drafted).
Since autospec changes k per iteration, it adds what vLLM's fixed k makes unnecessary:
``autospec:spec_decode_num_draft_tokens_per_pos`` (drafted tokens by position: acceptance at
position i is accepted_per_pos / draft_tokens_per_pos). Besides: k in force, iterations and
those run with speculation off (k = 0), the speculation-off share, generated tokens and
request seconds (tokens/s as a rate ratio) and the last request's tokens/s, the target's
achieved memory bandwidth and the device's peak, and fallbacks (requests sent to the
original ``generate``) by reason.

Everything is updated once per finished request, after generation (``Metrics.observe``),
never per token. Each ``Metrics`` has its own ``CollectorRegistry``.

**Multi-process servers** follow prometheus_client's multiprocess mode: set
``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before any process imports
prometheus_client; every process then writes its values there and ``start_http_server``
(in any one process) serves the sum over processes through a ``MultiProcessCollector``
(gauges: the most recent value written by any process — the speculation-off share is then
one process's; ``rate`` of the iteration counters gives all of them).
"""

from __future__ import annotations

import logging
import math
import os
import threading

log = logging.getLogger(__name__)

__all__ = ["Metrics", "Exporter", "start_http_server", "short_name", "pair_label",
           "SPEC_LABELS", "METRIC_NAMES"]

SPEC_LABELS = ("model_name", "category", "pair", "proposer")
PROPOSER = "draft"

# the exposed sample names (counters with ``_total``), for dashboards and their tests
METRIC_NAMES = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "autospec:spec_decode_num_draft_tokens_per_pos_total",
    "autospec:requests_total",
    "autospec:iterations_total",
    "autospec:iterations_speculation_off_total",
    "autospec:speculation_off_share",
    "autospec:k_in_force",
    "autospec:generation_tokens_total",
    "autospec:request_seconds_total",
    "autospec:tokens_per_second",
    "autospec:target_bandwidth_bytes_per_second",
    "autospec:target_bandwidth_peak_bytes_per_second",
    "autospec:target_bandwidth_utilisation",
    "autospec:fallbacks_total",
)


def short_name(name: str) -> str:
    """A model's short name: the last part of its path or hub id."""
    name = str(name).rstrip("/")
    return name.rsplit("/", 1)[-1] or name


def pair_label(target: str, draft: str) -> str:
    return f"{short_name(target)}/{short_name(draft)}"


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or
                os.environ.get("prometheus_multiproc_dir"))


class Metrics:
    """The live metrics of one or more controllers, in one registry."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry(
            auto_describe=True)
        self._lock = threading.Lock()
        # in-process running sums for the speculation-off share gauge
        self._iters: dict[tuple, list[int]] = {}
        labels = list(SPEC_LABELS)
        reg = {"registry": self.registry}
        last = {"multiprocess_mode": "mostrecent"}

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), **reg)

        def gauge(name, doc):
            return Gauge(name, doc, labels, **reg, **last)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                    "Number of draft tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                "Number of accepted tokens.")
        self.accepted_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", ("position",))
        self.drafted_pos = counter("autospec:spec_decode_num_draft_tokens_per_pos",
                                   "Draft tokens proposed per draft position.", ("position",))
        self.requests = counter("autospec:requests", "Requests served speculatively.")
        self.iterations = counter("autospec:iterations",
                                  "Draft-verify iterations (k = 0 included).")
        self.iterations_off = counter("autospec:iterations_speculation_off",
                                      "Iterations run with speculation off (k = 0).")
        self.off_share = gauge("autospec:speculation_off_share",
                               "Share of iterations with speculation off, since start.")
        self.k_in_force = gauge("autospec:k_in_force",
                                "k of the last iteration of the last request.")
        self.tokens = counter("autospec:generation_tokens", "Tokens generated.")
        self.seconds = counter("autospec:request_seconds",
                               "Wall seconds of speculative requests.")
        self.tokens_per_s = gauge("autospec:tokens_per_second",
                                  "Tokens per second of the last request.")
        self.bandwidth = gauge("autospec:target_bandwidth_bytes_per_second",
                               "Target's achieved memory bandwidth, last request.")
        self.peak = gauge("autospec:target_bandwidth_peak_bytes_per_second",
                          "The device's peak memory bandwidth (measured).")
        self.utilisation = gauge("autospec:target_bandwidth_utilisation",
                                 "Achieved over peak memory bandwidth, last request.")
        self.fallbacks = Counter("autospec:fallbacks",
                                 "Requests sent to the original generate, by reason.",
                                 ["model_name", "reason"], **reg)

    def observe(self, stats, *, category: str, target: str, draft: str,
                bandwidth: float | None = None, peak: float | None = None) -> None:
        """Count one finished request (a ``LoopStats``); never raises into the caller."""
        try:
            self._observe(stats, category, target, draft, bandwidth, peak)
        except Exception:
            log.exception("autospec: could not update the request's metrics")

    def _observe(self, stats, category, target, draft, bandwidth, peak) -> None:
        lv = (short_name(target), category, pair_label(target, draft), PROPOSER)
        # the model proposer's blocks under the pair's series; every other proposer's (those
        # that proposed) under its own name's
        counts = [(lv, stats.proposer(stats.model))]
        counts += [((*lv[:3], name), c) for name, c in stats.counts.items()
                   if name != stats.model and c.blocks]
        for labels, c in counts:
            self.drafts.labels(*labels).inc(c.blocks)
            self.draft_tokens.labels(*labels).inc(c.proposed)
            self.accepted.labels(*labels).inc(c.accepted)
            accepted, drafted = c.accepted_per_position, c.proposed_per_position
            for pos in range(max(len(accepted), len(drafted))):  # they may differ in length
                self.accepted_pos.labels(*labels, str(pos)).inc(
                    accepted[pos] if pos < len(accepted) else 0)
                self.drafted_pos.labels(*labels, str(pos)).inc(
                    drafted[pos] if pos < len(drafted) else 0)
        ks = stats.k_schedule
        off = sum(1 for k in ks if k == 0)
        self.requests.labels(*lv).inc()
        self.iterations.labels(*lv).inc(len(ks))
        self.iterations_off.labels(*lv).inc(off)
        with self._lock:
            cell = self._iters.setdefault(lv, [0, 0])
            cell[0] += len(ks)
            cell[1] += off
            share = cell[1] / cell[0] if cell[0] else None
        if share is not None:
            self.off_share.labels(*lv).set(share)
        if ks:
            self.k_in_force.labels(*lv).set(ks[-1])
        self.tokens.labels(*lv).inc(stats.new_tokens)
        self.seconds.labels(*lv).inc(max(stats.wall_s, 0.0))
        if stats.wall_s > 0:
            self.tokens_per_s.labels(*lv).set(stats.new_tokens / stats.wall_s)
        if bandwidth is not None:
            self.bandwidth.labels(*lv).set(bandwidth)
        if peak:
            self.peak.labels(*lv).set(peak)
            if bandwidth is not None:
                self.utilisation.labels(*lv).set(bandwidth / peak)

    def fallback(self, reason: str, target: str) -> None:
        try:
            self.fallbacks.labels(short_name(target), reason).inc()
        except Exception:
            log.exception("autospec: could not count a fallback in the metrics")


_default: Metrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> Metrics:
    """The process's shared ``Metrics`` (what ``wrap(..., metrics=True)`` uses)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Metrics()
        return _default


class Exporter:
    """A running ``/metrics`` endpoint: ``port`` (the bound one, also for port 0),
    ``registry``, ``close()``."""

    def __init__(self, server, thread, registry):
        self.server, self.thread, self.registry = server, thread, registry
        self.port = server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.server.server_address[0]}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_registry(registry, port: int = 0, addr: str = "127.0.0.1") -> Exporter:
    """Serve ``registry`` on ``addr:port`` (0: a free port) from a daemon thread."""
    from prometheus_client import start_http_server as _start

    server, thread = _start(port, addr=addr, registry=registry)
    log.info("autospec: serving metrics on http://%s:%d/metrics", addr, server.server_port)
    return Exporter(server, thread, registry)


def start_http_server(port: int = 0, addr: str = "127.0.0.1",
                      metrics: Metrics | None = None) -> Exporter:
    """Serve the live metrics (``metrics``, else the process's shared ones that
    ``wrap(..., metrics=True)`` updates). Under ``PROMETHEUS_MULTIPROC_DIR`` it serves
    every process's values, summed, instead."""
    metrics = metrics if metrics is not None else default_metrics()
    registry = metrics.registry
    if _multiprocess():
        from prometheus_client import CollectorRegistry, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return serve_registry(registry, port, addr)


class RequestHook:
    """What a controller calls when a request finishes (``observe``) or falls back
    (``fallback``): names the pair as the store does and measures bandwidth as it does."""

    def __init__(self, metrics: Metrics, target, draft, *, names=None, telemetry=None):
        from autospec import telemetry as tm

        self.metrics = metrics
        self.telemetry = telemetry
        if telemetry is not None:
            self.target, self.draft = telemetry.pair.target, telemetry.pair.draft
            self.target_bytes, self.kv_per_token = telemetry.target_bytes, telemetry.kv_per_token
        else:
            self.target, self.draft = names or (tm._model_name(target), tm._model_name(draft))
            self.target_bytes = tm.param_bytes(target)
            self.kv_per_token = tm.kv_bytes_per_token(target)

    def observe(self, stats, category: str) -> None:
        try:
            from autospec.telemetry import achieved_bandwidth

            bw = achieved_bandwidth(self.target_bytes, self.kv_per_token, stats.target_forwards)
            peak = getattr(self.telemetry, "peak", None)
        except Exception:
            log.exception("autospec: could not measure the request's bandwidth for metrics")
            bw = peak = None
        self.metrics.observe(stats, category=category, target=self.target, draft=self.draft,
                             bandwidth=bw, peak=peak)

    def fallback(self, reason: str) -> None:
        self.metrics.fallback(reason, self.target)


def as_metrics(option) -> Metrics | None:
    """``wrap``'s ``metrics`` option: False/None — none; True — the process's shared
    ``Metrics``; a ``Metrics`` — that one."""
    if option is None or option is False:
        return None
    if option is True:
        return default_metrics()
    if isinstance(option, Metrics):
        return option
    raise ValueError(f"metrics must be True, False or an autospec.fleet.metrics.Metrics, "
                     f"got {option!r}")


# -- fleet metrics from the store ------------------------------------------------------------

STORE_LABELS = (*SPEC_LABELS, "hardware")

# what the store exporter adds to the live names (it has no fallbacks: those are not stored)
STORE_METRIC_NAMES = (
    "autospec:speedup_estimate",
    "autospec:speedup_estimate_k",
    "autospec:speedup_estimate_by_batch",
    "autospec:k_by_batch",
    "autospec:store_up",
)


class StoreCollector:
    """A prometheus_client collector that reads the store's per-(category, pair) aggregates
    on every scrape: the live exporter's counters (summed over every process that ever wrote
    the store; the draft model's blocks under ``proposer="draft"``, each lookup proposer's
    under its own name, as ``Metrics`` labels them), the k in force (the k the recent
    requests ran most), the speculation-off share, tokens/s, bandwidth against peak, and the
    cost model's speedup estimate, also per batch size — all as ``autospec report`` computes
    them (``autospec.report.build_report``). The store is only read; a failing read is
    logged and scraped as ``autospec:store_up 0``."""

    def __init__(self, store, *, category: str | None = None):
        self.store = store
        self.category = category

    def describe(self):
        return []  # collected per scrape: nothing to check at registration

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("autospec:store_up", "1 if the last read of the store worked.")
        try:
            families = self._families()
        except Exception:
            log.exception("autospec: could not read the store for metrics")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield from families
        yield up

    def _families(self):
        from autospec.report import build_report
        from autospec.store import queries

        with self.store.session() as s:
            summaries = queries.category_summaries(s, category=self.category)
            report = build_report(s, category=self.category, store_url=self.store.url)
        work = {(w.category, w.pair["id"]): w for w in report.workloads}
        fam = _store_families()
        for sm in summaries:
            _add_summary(fam, sm, work.get((sm.category, sm.pair.id)))
        return list(fam.values())


def _store_families() -> dict:
    """The store exporter's metric families, empty (``StoreCollector`` and ``backfill``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = list(STORE_LABELS)

    def counter(name, doc, extra=()):
        return CounterMetricFamily(name, doc, labels=labels + list(extra))

    def gauge(name, doc, extra=()):
        return GaugeMetricFamily(name, doc, labels=labels + list(extra))

    return {
        "drafts": counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
        "drafted": counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
        "accepted": counter("vllm:spec_decode_num_accepted_tokens",
                            "Number of accepted tokens."),
        "acc_pos": counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                           "Accepted tokens per draft position.", ("position",)),
        "dra_pos": counter("autospec:spec_decode_num_draft_tokens_per_pos",
                           "Draft tokens proposed per draft position.", ("position",)),
        "requests": counter("autospec:requests", "Requests served speculatively."),
        "iterations": counter("autospec:iterations", "Draft-verify iterations."),
        "off": counter("autospec:iterations_speculation_off",
                       "Iterations run with speculation off (k = 0)."),
        "tokens": counter("autospec:generation_tokens", "Tokens generated."),
        "seconds": counter("autospec:request_seconds", "Wall seconds of requests."),
        "share": gauge("autospec:speculation_off_share",
                       "Share of iterations with speculation off."),
        "k": gauge("autospec:k_in_force", "The k the recent requests ran most."),
        "tps": gauge("autospec:tokens_per_second", "Tokens per second over all requests."),
        "bw": gauge("autospec:target_bandwidth_bytes_per_second",
                    "Target's achieved memory bandwidth (time-weighted)."),
        "peak": gauge("autospec:target_bandwidth_peak_bytes_per_second",
                      "The device's peak memory bandwidth."),
        "util": gauge("autospec:target_bandwidth_utilisation",
                      "Achieved over peak memory bandwidth."),
        "speedup": gauge("autospec:speedup_estimate",
                         "Cost model's S(k) at the k in force (else the most used k > 0)."),
        "speedup_k": gauge("autospec:speedup_estimate_k", "The k that estimate is for."),
        "by_batch": gauge("autospec:speedup_estimate_by_batch",
                          "Cost model's predicted speedup over plain batched decoding at "
                          "its k, per batch size of the pair's cost grid.", ("batch",)),
        "k_by_batch": gauge("autospec:k_by_batch",
                            "Cost model's k per batch size of the pair's cost grid.",
                            ("batch",)),
    }


def _add_summary(fam: dict, sm, w, timestamp: float | None = None) -> None:
    """Add one (category, pair) summary's samples to ``fam`` (``_store_families``); ``w``,
    its report workload (None: no k in force, speedup or batch figures)."""
    p = sm.pair
    lv = [short_name(p.target), sm.category, pair_label(p.target, p.draft), PROPOSER,
          p.hardware]
    ts = {"timestamp": timestamp}

    def add(key, labels, value):
        fam[key].add_metric(labels, value, **ts)

    def drafting(labels, drafts, drafted, accepted, acc, dra):
        add("drafts", labels, drafts)
        add("drafted", labels, drafted)
        add("accepted", labels, accepted)
        acc, dra = list(acc), list(dra)
        for pos in range(max(len(acc), len(dra))):
            add("acc_pos", [*labels, str(pos)], acc[pos] if pos < len(acc) else 0)
            add("dra_pos", [*labels, str(pos)], dra[pos] if pos < len(dra) else 0)

    drafting(lv, sm.drafts, sm.drafted, sm.accepted, sm.accepted_per_position,
             sm.drafted_per_position)
    for name, ps in sorted(sm.proposers.items()):  # every other proposer that proposed, under
        if ps.kind != "model" and ps.blocks:      # its own name, as the live metrics count
            drafting([*lv[:3], name, lv[4]], ps.blocks, ps.proposed, ps.accepted,
                     ps.accepted_per_position, ps.proposed_per_position)
    add("requests", lv, sm.requests)
    add("iterations", lv, sm.iterations)
    off = sm.k_counts.get(0, 0)
    add("off", lv, off)
    add("tokens", lv, sm.new_tokens)
    add("seconds", lv, sm.wall_s)
    if sm.iterations:
        add("share", lv, off / sm.iterations)
    for key, value in (("tps", sm.tokens_per_s), ("bw", sm.bandwidth_bytes_per_s),
                       ("peak", sm.bandwidth_peak_bytes_per_s),
                       ("util", sm.bandwidth_utilisation)):
        if value is not None:
            add(key, lv, value)
    if w is None:
        return
    if w.policy.k_in_force is not None:
        add("k", lv, w.policy.k_in_force)
    if w.speedup.estimated is not None and w.speedup.k is not None:
        add("speedup", lv, w.speedup.estimated)
        add("speedup_k", lv, w.speedup.k)
    for pt in (w.batch.points if w.batch is not None else []):
        if pt.speedup is not None:
            add("by_batch", [*lv, str(pt.batch)], pt.speedup)
        if pt.k is not None:
            add("k_by_batch", [*lv, str(pt.batch)], pt.k)


def serve_store(store, port: int = 0, addr: str = "127.0.0.1", *,
                category: str | None = None) -> Exporter:
    """Serve the store's per-category aggregates (``StoreCollector``, read per scrape)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, category=category))
    return serve_registry(registry, port, addr)


# the store families the collector takes from the report (``build_report``), not the sums
_FROM_REPORT = ("speedup", "speedup_k", "by_batch", "k_by_batch")


def backfill(store, out, *, step: float = 60.0, category: str | None = None) -> int:
    """Write the store's history as OpenMetrics text with timestamps, for Prometheus to load
    (``promtool tsdb create-blocks-from openmetrics FILE DIR``): what ``StoreCollector``
    would have served had it been scraped every ``step`` seconds (whole milliseconds, as
    Prometheus keeps them) since the first request.

    The requests are replayed in ``created_at`` order. At every step before the last request,
    and at the last request's time it emits the running counters (drafts, draft and accepted
    tokens and by position, requests, iterations and those with speculation off, generated
    tokens, request seconds) and the gauges that follow from those sums alone
    (speculation-off share, tokens/s, bandwidth, its peak and utilisation) or from the
    latest requests (k in force: the k the latest ``RECENT`` batch-1 requests ran most, as
    the report takes it). The cost model's speedup estimates (also per batch size) and
    ``autospec:store_up`` come only at that last time, from the collector's own read of the
    store. Same names, labels and help text as the collector (one definition).
    ``out``: a writable text file. Returns the number of samples written."""
    from collections import Counter, deque
    from datetime import timezone

    from prometheus_client.openmetrics import exposition
    from sqlalchemy import select

    from autospec.report.model import RECENT
    from autospec.store import queries
    from autospec.store.damage import LISTS, SUMS, note, request_note, request_problem
    from autospec.store.tables import Request, RequestProposer
    from autospec.store.write import category_key

    if not step > 0:
        raise ValueError(f"step must be positive, got {step!r}")
    cols = (Request.id, Request.created_at, Request.category_key, Request.pair_id,
            Request.category, Request.new_tokens, Request.prompt_tokens, Request.iterations,
            Request.k_schedule, Request.wall_s, Request.prefill_s, Request.target_s_by_n,
            Request.target_s_by_bn, Request.bandwidth_bytes_per_s,
            Request.bandwidth_peak_bytes_per_s, Request.batch_size, Request.policy)
    stmt = select(*cols).order_by(Request.created_at, Request.id)
    # every request's proposer rows, counters only (the traces stay unread)
    # (by name within a request: its first damaged row is the one every reader names)
    pstmt = (select(RequestProposer.request_id, RequestProposer.proposer, RequestProposer.kind,
                    *(getattr(RequestProposer, c) for c in (*SUMS, *LISTS)))
             .order_by(RequestProposer.request_id, RequestProposer.proposer))
    if category is not None:
        stmt = stmt.where(Request.category_key == category_key(category))
        pstmt = pstmt.join(Request, Request.id == RequestProposer.request_id).where(
            Request.category_key == category_key(category))
    with store.session() as s:
        pairs = {p.id: p for p in queries.pairs(s)}
        names = {(category_key(sm.category), sm.pair.id): sm.category  # the stats row's
                 for sm in queries.category_summaries(s, category=category)}
        rows = list(s.execute(stmt))
        proposers: dict[int, list] = {}
        for pr in s.execute(pstmt):
            proposers.setdefault(pr.request_id, []).append(pr)

    def epoch(t) -> float:
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()

    fam = _store_families()
    sums: dict[tuple[str, int], dict] = {}

    def emit(ts: float) -> None:
        for (key, pid), a in sums.items():
            seen = (a["first"], a["last"])
            _add_summary(fam, queries.CategorySummary(
                category=names.get((key, pid), a["category"]), pair=pairs[pid],
                requests=a["requests"], prompt_tokens=a["prompt_tokens"],
                new_tokens=a["new_tokens"], iterations=a["iterations"], draft_s=0.0,
                draft_forwards=0, target_s_sum_by_n={}, target_count_by_n={},
                k_counts=dict(a["k"]), wall_s=a["wall_s"], prefill_s=a["prefill_s"],
                bandwidth_bytes=a["bw_bytes"], bandwidth_s=a["bw_s"],
                bandwidth_peak_bytes_per_s=a["peak"], nvml_mem_busy_sum=0.0,
                nvml_mem_busy_n=0, nvml_sm_util_sum=0.0, nvml_sm_util_n=0,
                first_seen=seen[0], last_seen=seen[1],
                proposers={name: queries.ProposerSums(
                    name=name, kind=p["kind"], blocks=p["blocks"], proposed=p["proposed"],
                    accepted=p["accepted"], seconds=p["seconds"],
                    proposed_per_position=_as_list(p["proposed_per_position"]),
                    accepted_per_position=_as_list(p["accepted_per_position"]))
                    for name, p in a["proposers"].items()}), _k_only(a["recent_k"]), ts)

    # Prometheus keeps milliseconds: every step is a whole one, the last one rounded up
    step_ms = max(1, round(step * 1000))
    last = math.ceil(epoch(rows[-1].created_at) * 1000) if rows else None
    t = math.ceil(epoch(rows[0].created_at) * 1000) if rows else None
    for r in rows:
        mine = proposers.get(r.id, ())
        problem = next((p for p in map(request_problem, mine) if p is not None), None)
        if problem is not None:  # a damaged row: left out, and said (damage.note)
            note(request_note(r.id, r.category, r.pair_id, r.policy, problem))
            continue
        at = epoch(r.created_at) * 1000
        while t < at:  # the steps this request comes after
            emit(t / 1000)
            t += step_ms
        a = sums.setdefault((r.category_key, r.pair_id), dict(
            category=r.category, requests=0, prompt_tokens=0, new_tokens=0, iterations=0,
            k=Counter(), wall_s=0.0, prefill_s=0.0, bw_bytes=0.0, bw_s=0.0, peak=None,
            first=r.created_at, last=r.created_at, recent=deque(), recent_k=Counter(),
            proposers={}))
        a["requests"] += 1
        for name in ("prompt_tokens", "new_tokens", "iterations", "wall_s", "prefill_s"):
            a[name] += getattr(r, name)
        for pr in mine:  # every proposer's sums, as the store folds them
            p = a["proposers"].setdefault(pr.proposer, dict(
                kind=pr.kind, **{c: 0 for c in SUMS}, **{c: Counter() for c in LISTS}))
            for c in SUMS:
                p[c] += getattr(pr, c) or 0
            for c in LISTS:
                p[c].update(dict(enumerate(getattr(pr, c) or ())))
        ks = Counter(bytes(r.k_schedule or b""))
        a["k"].update(ks)
        if r.batch_size == 1:  # k in force: the latest RECENT requests at batch 1
            a["recent"].append(ks)
            a["recent_k"].update(ks)
            if len(a["recent"]) > RECENT:
                a["recent_k"].subtract(a["recent"].popleft())
        target_s = sum(sum(v) for m in (r.target_s_by_n, r.target_s_by_bn) for v in
                       (m or {}).values())
        if r.bandwidth_bytes_per_s is not None and target_s > 0:
            a["bw_bytes"] += r.bandwidth_bytes_per_s * target_s
            a["bw_s"] += target_s
        if r.bandwidth_peak_bytes_per_s is not None:
            a["peak"] = max(a["peak"] or 0.0, r.bandwidth_peak_bytes_per_s)
        a["last"] = r.created_at
    families = {f.name: f for f in fam.values()}
    if last is not None:  # the last step: the replay's sums, and what only the report has
        last /= 1000
        emit(last)
        replayed = {f.name for k, f in fam.items() if k not in _FROM_REPORT}
        for f in StoreCollector(store, category=category).collect():
            if f.name not in replayed:
                mine = families.setdefault(f.name, type(f)(f.name, f.documentation, labels=[]))
                mine.samples.extend(smp._replace(timestamp=last) for smp in f.samples)
    n = 0
    for f in families.values():  # one series' samples together, in time order
        f.samples.sort(key=lambda smp: (smp.name, sorted(smp.labels.items()), smp.timestamp))
        n += len(f.samples)

    class _Families:
        def collect(self):
            return iter(families.values())

    # names keep their colons (newer prometheus_client escapes them to "_" by default)
    utf8 = getattr(exposition, "ALLOWUTF8", None)
    kw = {"escaping": utf8} if utf8 else {}
    out.write(exposition.generate_latest(_Families(), **kw).decode("utf-8"))
    log.info("autospec: backfilled %d samples of %d requests", n, len(rows))
    return n


def _k_only(recent_k):
    """A stand-in for ``_add_summary``'s report workload that has only the k in force (the k
    run most, ties: the larger, as ``RecentActivity.k_mode``)."""
    from types import SimpleNamespace

    counts = {k: n for k, n in recent_k.items() if n > 0}
    k = max(counts, key=lambda k: (counts[k], k)) if counts else None
    return SimpleNamespace(policy=SimpleNamespace(k_in_force=k),
                           speedup=SimpleNamespace(estimated=None, k=None), batch=None)


def _as_list(c) -> tuple[int, ...]:
    return tuple(c[i] for i in range(max(c) + 1)) if c else ()
