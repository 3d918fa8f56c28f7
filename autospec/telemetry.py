"""Telemetry: what a finished request's record holds beyond its counters (bandwidth figures,
the device's peak, NVML samples), assembled once per request, off the per-token path.
Acceptance traces are ``autospec.traces``; the engine's timing is ``autospec.engine.timing``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from autospec.engine.slots import kv_bytes_per_token  # the slot cache's unit
from autospec.traces import NO_DRAFT

log = logging.getLogger(__name__)

__all__ = ["param_bytes", "kv_bytes_per_token",
           "achieved_bandwidth", "peak_bandwidth", "hardware_name", "NvmlSampler",
           "nvml_device_ref", "nvml_handle"]





def param_bytes(model) -> int:
    if model is None:
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters())


def achieved_bandwidth(weights: int, kv_per_token: int, forwards: list[tuple[int, float]]):
    """Median bytes/s over target forwards: (weights + KV read) ÷ time.

    forwards: (cached tokens before the forward, seconds). A decoding forward reads every
    weight once and the whole cache once, whatever the number of tokens it scores.
    """
    rates = [(weights + kv_per_token * cached) / s for cached, s in forwards if s > 0]
    return statistics.median(rates) if rates else None


# -- the device's peak -----------------------------------------------------------------------

def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {cpu} ({torch.get_num_threads()} threads)"


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver, no device: figures stay absent
        log.debug("NVML unavailable: %s", e)
        return None
    return pynvml


def nvml_device_ref(index: int, visible: str | None) -> int | str:
    """torch's CUDA device index → how NVML knows that device: its physical index, or the
    UUID (or unique UUID prefix, or MIG id) ``CUDA_VISIBLE_DEVICES`` names it by. torch counts
    only the visible devices, NVML all of them: with CUDA_VISIBLE_DEVICES=2,3, torch's cuda:0
    is NVML's device 2. As CUDA does, the list ends at its first empty or negative entry."""
    if visible is None:
        return index
    entries = []
    for item in visible.split(","):
        item = item.strip()
        if not item or (item.lstrip("-").isdigit() and int(item) < 0):
            break
        entries.append(item)
    if not 0 <= index < len(entries):
        raise ValueError(f"cuda:{index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[index]
    return int(entry) if entry.isdigit() else entry


def nvml_handle(nvml, index: int, *, uuid: str | None = None, visible: str | None = None):
    """NVML's handle for torch's cuda:``index``: by the device's ``uuid`` when torch knows it
    (exact whatever the visible list or CUDA_DEVICE_ORDER), else by ``nvml_device_ref``."""
    if uuid:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-"))
                                                  else f"GPU-{uuid}")
        except Exception as e:  # an older driver, a MIG instance: try the visible list
            log.debug("NVML has no device with UUID %s: %s", uuid, e)
    ref = nvml_device_ref(index, visible)
    if isinstance(ref, int):
        return nvml.nvmlDeviceGetHandleByIndex(ref)
    try:
        return nvml.nvmlDeviceGetHandleByUUID(ref)
    except Exception:  # a prefix, or without its "GPU-": match it against every device
        pass
    found = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        full = nvml.nvmlDeviceGetUUID(handle)
        full = full.decode() if isinstance(full, bytes) else str(full)
        if full.startswith(ref) or full.startswith(f"GPU-{ref}"):
            found.append(handle)
    if len(found) != 1:
        raise ValueError(f"CUDA_VISIBLE_DEVICES entry {ref!r} matches {len(found)} NVML devices")
    return found[0]


def _torch_nvml_handle(nvml, device: torch.device):
    """The NVML handle of a torch CUDA device (see ``nvml_handle``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return nvml_handle(nvml, index, uuid=str(uuid) if uuid else None,
                       visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


def measure_copy_bandwidth(size_mb: int = 256, repeats: int = 5) -> float:
    """Bytes/s this machine's memory streams at, best of ``repeats``: the faster of a copy
    (read + write counted) and a read-only reduction — decoding mostly reads weights, and a
    copy alone underestimates what reads achieve."""
    src = torch.empty(size_mb * 2**20 // 4, dtype=torch.float32)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        src.sum()
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def peak_bandwidth(device: torch.device, cache_dir=None) -> float | None:
    """The device's peak memory bandwidth in bytes/s.

    NVIDIA: memory clock × bus width from NVML (× 2 for double data rate). CPU: a measured
    copy, cached per machine and thread count in the cache directory so it runs once.
    """
    if device.type == "cuda":
        nvml = _nvml()
        if nvml is None:
            return None
        try:
            h = _torch_nvml_handle(nvml, device)
            clock_mhz = nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_MEM)
            bus_bits = nvml.nvmlDeviceGetMemoryBusWidth(h)
            return clock_mhz * 1e6 * 2 * bus_bits / 8
        except Exception as e:
            log.debug("NVML peak bandwidth unavailable: %s", e)
            return None
    if device.type != "cpu":
        return None
    key = f"{hardware_name(device)}"
    path = None
    if cache_dir is not None:
        path = os.path.join(cache_dir, "bandwidth.json")
        try:
            with open(path, encoding="utf-8") as f:
                known = json.load(f)
            if key in known:
                return float(known[key])
        except (OSError, ValueError):
            known = {}
    peak = measure_copy_bandwidth()
    _cache_peak(path, key, peak)
    return peak


def _cache_peak(path: str | None, key: str, peak: float) -> None:
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        known = {} if not os.path.exists(path) else json.load(open(path, encoding="utf-8"))
        known[key] = peak
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(known, f)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        log.debug("could not cache the bandwidth figure: %s", e)


# below this many bytes per forward a model may stream from CPU caches, not from memory
CACHE_RESIDENT_BYTES = 256 * 2**20


def raise_peak(device: torch.device, cache_dir, peak: float | None,
               achieved: float | None, streamed_bytes: int) -> float | None:
    """A CPU peak measured once on a busy machine can sit below what decoding later
    achieves (a utilisation over 100 %). The peak is never below an achieved figure: raise
    it, and the cached value with it, so later reports and probes read a consistent one.
    Models small enough to stream from the CPU's caches (``streamed_bytes``, weights + KV
    per forward) say nothing about memory and are ignored."""
    if (device.type != "cpu" or not achieved or (peak and achieved <= peak)
            or streamed_bytes < CACHE_RESIDENT_BYTES):
        return peak
    log.info("autospec: the measured peak bandwidth (%.1f GB/s) was below what the target "
             "achieved (%.1f GB/s), probably measured on a busy machine; raised to it",
             (peak or 0) / 1e9, achieved / 1e9)
    if cache_dir is not None:
        _cache_peak(os.path.join(cache_dir, "bandwidth.json"), hardware_name(device), achieved)
    return achieved


# -- NVML sampling ----------------------------------------------------------------------------

@dataclass
class _Sample:
    t: float
    mem_busy: float
    sm_util: float


class NvmlSampler:
    """Samples NVML's memory-busy and SM utilisation on a background thread.

    ``window(t0, t1)`` averages the samples taken during a request. Absent NVML (CPU, no
    driver, pynvml not installed) it does nothing and every window is (None, None).
    """

    def __init__(self, device: torch.device, interval_s: float = 0.05, keep: int = 4096):
        self._samples: list[_Sample] = []
        self._keep = keep
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        nvml = _nvml() if device.type == "cuda" else None
        if nvml is None:
            return
        self._nvml = nvml
        try:
            self._handle = _torch_nvml_handle(nvml, device)
        except Exception as e:  # no figures rather than another device's
            log.debug("NVML sampling unavailable: %s", e)
            return
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, name="autospec-nvml", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                u = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            except Exception as e:
                log.debug("NVML sampling stopped: %s", e)
                return
            with self._lock:
                self._samples.append(_Sample(time.time(), float(u.memory), float(u.gpu)))
                if len(self._samples) > self._keep:
                    del self._samples[: self._keep // 2]

    def window(self, t0: float, t1: float) -> tuple[float | None, float | None]:
        with self._lock:
            inside = [s for s in self._samples if t0 <= s.t <= t1]
        if not inside:
            return None, None
        return (statistics.fmean(s.mem_busy for s in inside),
                statistics.fmean(s.sm_util for s in inside))

    def close(self) -> None:
        self._stop.set()


# -- per-request records for the store --------------------------------------------------------

class RequestTelemetry:
    """Everything a controller needs to turn a finished request into a store record."""

    def __init__(self, target, draft, *, names: tuple[str, str] | None = None,
                 cache_dir=None, measure_peak: bool = True):
        from autospec.store.record import PairInfo

        device = next(target.parameters()).device
        self.device = device
        self.target_bytes = param_bytes(target)
        self.kv_per_token = kv_bytes_per_token(target)
        t_name, d_name = names or (_model_name(target), _model_name(draft))
        self.pair = PairInfo(target=t_name, draft=d_name,
                             dtype=str(next(target.parameters()).dtype).replace("torch.", ""),
                             hardware=hardware_name(device), target_param_bytes=self.target_bytes,
                             draft_param_bytes=param_bytes(draft))
        self.peak = peak_bandwidth(device, cache_dir) if measure_peak else None
        self.cache_dir = cache_dir
        self.nvml = NvmlSampler(device)

    def record(self, stats, *, category: str, policy: str, greedy: bool,
               prompt_text: str | None = None, output_text: str | None = None):
        from autospec.store.record import ProposerRecord, RequestRecord

        achieved = achieved_bandwidth(self.target_bytes, self.kv_per_token,
                                      stats.target_forwards)
        mem_busy, sm = self.nvml.window(stats.started_at, stats.started_at + stats.wall_s)
        from autospec.engine.proposers import registered

        kinds = {name: cls.kind for name, cls in registered().items()}
        # every proposer the call had (its counts, its trace, what else it recorded)
        proposers = {}
        for name in {*stats.counts, *stats.traces, *stats.extras}:
            c, extras = stats.proposer(name), dict(stats.extras.get(name) or {})
            confidence = extras.pop("confidence", None)
            proposers[name] = ProposerRecord(
                kind=kinds.get(name, "model" if name == stats.model else "lookup"),
                blocks=c.blocks, proposed=c.proposed, accepted=c.accepted,
                proposed_per_position=list(c.proposed_per_position),
                accepted_per_position=list(c.accepted_per_position), seconds=c.seconds,
                trace=stats.traces.get(name), confidence=confidence, settings=extras or None)
        return RequestRecord(
            pair=self.pair, category=category, policy=policy, greedy=greedy,
            prompt_tokens=stats.prompt_tokens, new_tokens=stats.new_tokens,
            iterations=stats.iterations, proposers=proposers,
            proposer_schedule=list(stats.proposer_schedule) if proposers else None,
            k_schedule=bytes(min(k, 255) for k in stats.k_schedule),
            accepted_schedule=bytes(min(m, 255) for m in stats.accepted_schedule),
            wall_s=stats.wall_s, prefill_s=stats.prefill_s, draft_s=stats.draft_s,
            draft_forwards=stats.draft_forwards,
            target_s_by_n={n: list(v) for n, v in stats.target_s_by_n.items()},
            trace_kind=stats.trace_kind, stop_reason=stats.stop_reason,
            max_new_tokens=getattr(stats, "max_new_tokens", 0) or None,
            bandwidth_bytes_per_s=achieved, bandwidth_peak_bytes_per_s=self._peak(achieved),
            nvml_mem_busy_pct=mem_busy, nvml_sm_util_pct=sm,
            prompt_text=prompt_text, output_text=output_text,
            created_at=stats.started_at,
            # a row of a batched generate: the batch it ran in and its forwards at B > 1
            batch_size=getattr(stats, "batch_size", 1),
            target_s_by_bn={(int(b), int(n)): list(v) for (b, n), v
                            in getattr(stats, "target_s_by_bn", {}).items()} or None,
            draft_s_by_b={int(b): list(v) for b, v
                          in getattr(stats, "draft_s_by_b", {}).items()} or None,
            # the runners' path (autospec.engine.runners.path_name): costs are kept per path
            path=getattr(stats, "path", "") or None,
            # batch 1's catch-up forwards (the batched loop times its draft per batch)
            draft_catch_ups=(list(getattr(stats, "draft_catch_ups", ()))
                             if getattr(stats, "batch_size", 1) == 1
                             and self.pair.draft != NO_DRAFT else None),
            decisions=getattr(stats, "decisions", None), batch_id=stats.batch_id,
        )

    def _peak(self, achieved: float | None) -> float | None:
        if self.peak is not None:  # not measured at all stays unknown
            self.peak = raise_peak(self.device, self.cache_dir, self.peak, achieved,
                                   self.target_bytes)
        return self.peak

    def close(self) -> None:
        self.nvml.close()


def _model_name(model) -> str:
    if model is None:
        return NO_DRAFT
    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    return str(name) if name else type(model).__name__
