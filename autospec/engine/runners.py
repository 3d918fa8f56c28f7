"""How the loop runs a model's forward: the eager reference, or a static KV cache with graphs.

The loop asks two things of a runner: ``run(ids [B, n], keep) -> logits [B, keep, V]`` scores
n new tokens on top of the cache and appends them to it; ``crop(length)`` forgets everything
past ``length`` cached tokens.

- ``EagerRunner``: transformers' DynamicCache, a fresh one per request; cropping drops tensors.
  The reference path and the default.
- ``StaticRunner``: a preallocated StaticCache of ``capacity`` tokens, kept with the model and
  reused across requests until ``release_runners(model)`` (the controller's ``close`` and
  ``unwrap`` call it). Capacities come in buckets — powers of two from 256 tokens, at most the
  model's context — and a request takes a runner of its own bucket: attention spans the whole
  capacity, so a short request after a long one must not attend over the long one's cache.
  Cropping only moves the write position back: entries past it are
  stale, and the causal mask the runner builds from the positions hides them until the next
  forward overwrites them. Positions and mask are computed on the device from the cache's own
  length tensor, so a forward needs no host round trip (transformers' own mask code would
  read the static cache's length on the host for n > 1), and on CUDA a forward can be captured
  as a graph: one per number of scored tokens n (1 for a draft step, k + 1 for verification,
  2 for the draft's catch-up after a bonus), captured lazily on first use and replayed from
  static input and output buffers. Prefills (n > ``max_graph_tokens``) run eagerly on the same
  cache. The logits a graph returns live in its static output buffer: they are valid until the
  runner's next ``run``, which is all the loop needs (it consumes them within the iteration).

Exactness: a static forward scores the same tokens at the same positions against the same
keys and values; masked stale entries contribute exactly zero. Kernels differ from the
dynamic path (attention spans the whole capacity), so results agree to rounding, and greedy
fp32 output equals ``generate``'s (tests/test_static_cache.py, tests/test_gpu_path.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
import weakref

import torch

log = logging.getLogger(__name__)

__all__ = ["Forward", "new_cache", "crop_cache", "EagerRunner", "StaticRunner",
           "StaticUnsupported", "open_runner", "resolve_graphs", "graph_report", "path_name",
           "PATHS", "release_runners", "capacity_bucket"]

CAPACITY_STEP = 256  # the smallest static cache, in tokens; larger ones double
MAX_RUNNERS = 4  # static runners kept per model (roles, concurrent requests, buckets)
WARMUP = 2  # eager runs before a capture (cuBLAS workspaces, lazy kernels)


# -- the eager reference ------------------------------------------------------------------
def new_cache(model):
    """A fresh DynamicCache for ``model`` whose every layer keeps every token, so that it can
    be cropped back to an accepted prefix: transformers' sliding-window layers drop the
    tokens a rejected block needs back, so a model with sliding layers gets full ones (its
    windows are applied by the attention masks; ``checks.attention_layout``)."""
    from transformers import DynamicCache

    from autospec.engine.checks import attention_layout

    if attention_layout(model).sliding:
        return DynamicCache()  # every layer a full DynamicLayer, made as it is first used
    return DynamicCache(config=model.config)


class Forward:
    """Calls a causal LM with its cache, whatever the installed transformers names things."""

    def __init__(self, model):
        self.model = model
        self.cache_kw, self.has_keep = _forward_args(type(model))

    def __call__(self, ids: torch.Tensor, cache, keep: int, *,
                 attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, hidden: bool = False):
        """ids [B, n] → logits [B, keep, V] of the last ``keep`` positions (``hidden``: and
        the last layer's hidden states there, [B, keep, d], as a pair). At batch > 1 the loop
        passes the mask over every cache slot plus the new ones ([B, S + n]) and each token's
        position ([B, n]): slots may hold padding or rejected drafts."""
        kwargs = {self.cache_kw: cache, "use_cache": True}
        if self.has_keep:
            kwargs["logits_to_keep"] = keep
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if hidden:
            kwargs["output_hidden_states"] = True
        out = self.model(input_ids=ids, **kwargs)
        logits = out.logits if self.has_keep else out.logits[:, -keep:]  # [B, keep, V]
        return (logits, out.hidden_states[-1][:, -keep:]) if hidden else logits


@functools.lru_cache(maxsize=64)
def _forward_args(cls) -> tuple[str, bool]:
    """(the name its forward takes the cache by, whether it takes ``logits_to_keep``), per
    model class: every request opens runners, and reading a signature is slow."""
    params = inspect.signature(cls.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def crop_cache(cache, keep: int) -> None:
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)  # negative: remove that many tokens (every transformers 5.x)


class EagerRunner:
    """Transformers' DynamicCache, one per request: the reference path."""

    path = "eager"

    def __init__(self, model):
        self.fwd, self.cache = Forward(model), new_cache(model)
        self.dtype = next(model.parameters()).dtype

    def run(self, ids: torch.Tensor, keep: int, *, attention_mask=None,
            position_ids: torch.Tensor | None = None, hidden: bool = False):
        return self.fwd(ids, self.cache, keep, attention_mask=attention_mask,
                        position_ids=position_ids, hidden=hidden)

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)

    def release(self) -> None:
        self.cache = None


# -- the static path ----------------------------------------------------------------------
class StaticUnsupported(RuntimeError):
    """This model (or the installed transformers) cannot run on the static path."""


class _Graph:
    """One captured forward of n tokens: static input ids, static output logits."""

    def __init__(self, ids: torch.Tensor, out: torch.Tensor, graph, fn, nbytes: int | None):
        self.ids, self.out, self.graph, self.fn, self.nbytes = ids, out, graph, fn, nbytes

    def replay(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        if self.graph is not None:
            self.graph.replay()
        else:  # emulation (CPU tests): the same buffers, the same body, run again
            self.out.copy_(self.fn())
        return self.out


class StaticRunner:
    """A model on a static KV cache of ``capacity`` tokens, optionally replayed from graphs.

    graphs: None (eager forwards on the static cache), "cuda" (CUDA graphs) or "emulate"
    (the capture/replay bookkeeping without a device, for tests on the CPU).
    """

    def __init__(self, model, capacity: int, *, graphs: str | None = None, batch_size: int = 1,
                 max_graph_tokens: int = 32):
        param = next(model.parameters())
        self._model = weakref.ref(model)  # the registry is keyed by the model: no cycle
        self.name, self.device, self.dtype = type(model).__name__, param.device, param.dtype
        if graphs == "cuda" and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.graph_mode, self.batch, self.max_graph_tokens = graphs, batch_size, max_graph_tokens
        self.requested = graphs  # graph_mode drops to None if a capture fails
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise StaticUnsupported(f"attention implementation {impl!r} (static path: sdpa, eager)")
        self.float_mask = impl == "eager"  # eager attention adds the mask; sdpa takes booleans
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pass_cache_position = "cache_position" in params  # older transformers
        self.has_keep = "logits_to_keep" in params
        self.busy = False
        self.closed = False
        self.last_used = 0  # open_runner's counter when it last handed the runner out
        self.captures = 0  # graphs captured over the runner's life (re-captured after growth)
        self.capture_s = 0.0
        self.graphs: dict[int, _Graph] = {}
        self._pool = None
        self._alloc(capacity)

    @property
    def path(self) -> str:
        return path_name(True, self.graph_mode)

    @property
    def model(self):
        return self._model()

    def stale(self, model) -> bool:
        """The model moved to another device or dtype since the cache was built."""
        param = next(model.parameters())
        return (param.device, param.dtype) != (self.device, self.dtype)

    def _alloc(self, capacity: int) -> None:
        from transformers import StaticCache

        self.graphs.clear()  # graphs hold the old cache's addresses
        self._pool = None
        cfg = self.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        with torch.inference_mode(False), torch.no_grad():  # normal tensors, reusable anywhere
            try:  # the transformers 5 API; anything else is reported, and runs eagerly
                cache = StaticCache(config=cfg, max_cache_len=capacity)
                kinds = {type(layer).__name__ for layer in cache.layers}
                if kinds != {"StaticLayer"}:
                    raise StaticUnsupported(f"cache layers {sorted(kinds)} (static path: full "
                                            "attention layers only)")
                cache.early_initialization(batch_size=self.batch, num_heads=kv_heads,
                                           head_dim=head_dim, dtype=self.dtype,
                                           device=self.device)
            except (TypeError, AttributeError) as e:
                raise StaticUnsupported(f"this transformers' StaticCache: {e}") from e
            # every layer's write position is a view into one tensor: a crop is one fill_
            self.lens = torch.zeros(len(cache.layers), dtype=torch.long, device=self.device)
            for i, layer in enumerate(cache.layers):
                if not hasattr(layer, "cumulative_length"):
                    raise StaticUnsupported("this transformers' StaticLayer has no "
                                            "cumulative_length (a version autospec predates?)")
                layer.cumulative_length = self.lens[i]
            self.positions = torch.arange(capacity, device=self.device)  # [capacity]
        self.cache, self.capacity, self.length = cache, capacity, 0

    def reserve(self, need: int) -> None:
        """Start a request that may cache up to ``need`` tokens: empty, large enough."""
        if need > self.capacity:
            old = self.capacity
            self._alloc(capacity_bucket(need))
            log.info("autospec: static cache of %s grown from %d to %d tokens (graphs are "
                     "captured again as used)", self.name, old, self.capacity)
        self.crop(0)

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (layer.keys, layer.values))

    # -- forwards ---------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """The body every forward runs (and graphs capture): no host reads, no syncs."""
        B, n = ids.shape
        pos = self.lens[:1] + self.positions[:n]  # [n] positions of the new tokens
        allowed = self.positions[None, :] <= pos[:, None]  # [n, capacity]; stale entries: False
        if self.float_mask:
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~allowed, torch.finfo(self.dtype).min)
        else:
            mask = allowed
        kwargs = {self.cache_kw: self.cache, "use_cache": True,
                  "attention_mask": mask[None, None].expand(B, 1, n, self.capacity),
                  "position_ids": pos[None].expand(B, n)}
        if self.pass_cache_position:
            kwargs["cache_position"] = pos
        if self.has_keep:
            kwargs["logits_to_keep"] = keep
        return self.model(input_ids=ids, **kwargs).logits[:, -keep:]  # [B, keep, V]

    def run(self, ids: torch.Tensor, keep: int, *, attention_mask=None,
            position_ids=None) -> torch.Tensor:
        if attention_mask is not None or position_ids is not None:
            raise ValueError("a static runner serves one contiguous row: it builds its own "
                             "mask and positions")
        n = ids.shape[1]
        if self.length + n > self.capacity:
            raise ValueError(f"static cache overflow: {self.length} + {n} > {self.capacity}")
        # prefills (an empty cache) and long catch-ups run eagerly: graphs are for decoding
        graph = (self._graph(n) if self.graph_mode and 0 < self.length
                 and n <= self.max_graph_tokens else None)
        out = self._forward(ids, keep) if graph is None else graph.replay(ids)[:, -keep:]
        self.length += n
        return out

    def crop(self, length: int) -> None:
        if length < self.length:
            self.lens.fill_(length)  # a device-side write: no sync
            self.length = length

    def release(self) -> None:
        self.crop(0)
        self.busy = False
        if self.closed:  # released from the registry while it served a request
            self.close()

    def close(self) -> None:
        """Free the cache and graphs now (the runner is out of the registry; not reusable)."""
        self.closed = True
        if not self.busy:
            self.graphs.clear()
            self._pool = None
            self.cache = self.lens = self.positions = None

    # -- graphs -----------------------------------------------------------------------------
    def _graph(self, n: int) -> _Graph | None:
        graph = self.graphs.get(n)
        if graph is None:
            t0 = time.perf_counter()
            try:
                graph = self._capture(n)
            except Exception as e:  # never worse than eager: log, and stop capturing
                log.warning("autospec: capturing a %d-token forward of %s failed (%s: %s); "
                            "this runner continues without graphs", n, self.name,
                            type(e).__name__, e)
                self.graph_mode = None
                return None
            self.graphs[n] = graph
            self.captures += 1
            dt = time.perf_counter() - t0
            self.capture_s += dt
            log.info("autospec: captured the %d-token forward of %s in %.2f s (%s)", n,
                     self.name, dt,
                     "graph pool +%.1f MB" % (graph.nbytes / 1e6) if graph.nbytes is not None
                     else "emulated")
        return graph

    def _capture(self, n: int) -> _Graph:
        """Capture at the current write position. Warm-up runs write stale entries where the
        real forward is about to write anyway, and the position is restored after each."""
        start = self.length
        ids = torch.zeros(self.batch, n, dtype=torch.long, device=self.device)
        try:
            if self.graph_mode != "cuda":
                out = self._forward(ids, n).clone()
                return _Graph(ids, out, None, lambda: self._forward(ids, n), None)
            with torch.cuda.device(self.device):  # graphs capture on the current device
                stream = torch.cuda.current_stream()
                side = torch.cuda.Stream()
                side.wait_stream(stream)
                with torch.cuda.stream(side):
                    for _ in range(WARMUP):
                        self._forward(ids, n)
                        self.lens.fill_(start)
                stream.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    before = torch.cuda.memory_reserved()  # allocator statistics: no CUDA call
                    out = self._forward(ids, n)
                nbytes = max(0, torch.cuda.memory_reserved() - before)
            self._pool = graph.pool()  # later graphs share it (they never run concurrently)
            return _Graph(ids, out, graph, None, nbytes)
        finally:
            self.lens.fill_(start)

    def graph_memory(self) -> dict[int, int | None]:
        """Graph-pool bytes each capture added, by n (later captures reuse the shared pool,
        so most add little); None where graphs are emulated."""
        return {n: g.nbytes for n, g in sorted(self.graphs.items())}


# -- choosing a runner per request ----------------------------------------------------------
_LOCK = threading.Lock()
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → [StaticRunner]
_warned: set[tuple[int, str]] = set()
_uses = 0  # counts open_runner hand-outs: which free runner was used least recently


def capacity_bucket(need: int, context: int | None = None) -> int:
    """The static cache size for a request caching up to ``need`` tokens: the smallest power
    of two ≥ need, at least ``CAPACITY_STEP``, at most the model's ``context`` (when need
    fits it)."""
    cap = max(CAPACITY_STEP, 1 << max(0, need - 1).bit_length())
    if context and need <= context:
        cap = min(cap, context)
    return max(cap, need)


def static_fits(model, need: int) -> bool:
    """Whether a static cache of ``model`` can serve a request caching up to ``need`` tokens:
    within its positions (a request that may run past them runs eager, said once)."""
    context = _context(model)
    if context is None or need <= context:
        return True
    _warn_once(model, f"a request that may run past the model's {context} positions: eager "
               "forwards for it (a static cache is allocated whole)")
    return False


def _context(model) -> int | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ctx = getattr(cfg, "max_position_embeddings", None)
    return ctx if isinstance(ctx, int) and ctx > 0 else None


# The execution paths a timing can come from. Each measures a different thing (a static cache
# attends over its whole capacity; a graph replay drops the launch overhead), so the store
# keeps costs per path and never mixes two in one S(k).
PATHS = ("eager", "static", "static+cuda-graphs", "static+emulate")


def path_name(static: bool, graphs: str | None = None) -> str:
    """The path a runner of these settings runs on ("eager", "static", "static+cuda-graphs",
    "static+emulate"): what a request's and a probe's timings are stored under. A loop whose
    target and draft ran on different paths records "target/draft"."""
    if not static:
        return "eager"
    return {None: "static", "cuda": "static+cuda-graphs"}.get(graphs, f"static+{graphs}")


def resolve_graphs(option, device: torch.device) -> str | None:
    """``cuda_graphs`` option → graph mode: "auto" (CUDA graphs where the device is CUDA),
    True (required), False/None (none), "emulate" (tests)."""
    if option in (False, None):
        return None
    if option == "emulate":
        return "emulate"
    if option is True or option == "cuda":
        if device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the models on a CUDA device "
                             "(use 'auto' to capture graphs only where there is one)")
        return "cuda"
    if option == "auto":
        return "cuda" if device.type == "cuda" and torch.cuda.is_available() else None
    raise ValueError(f"cuda_graphs must be 'auto', True, False or 'emulate', got {option!r}")


def open_runner(model, need: int, *, static: bool, graphs: str | None = None):
    """A runner for one request that caches up to ``need`` tokens: when ``static``, the model's
    free static runner of that capacity bucket (``capacity_bucket``), made if there is none —
    in place of the least recently used free runner of another bucket once the model has
    ``MAX_RUNNERS``; else, or when the static path is unavailable or every static runner is
    busy, a fresh eager one. Release it with ``runner.release()``."""
    global _uses
    if not static:
        return EagerRunner(model)
    capacity = capacity_bucket(need, _context(model))
    runner = None
    with _LOCK:
        pool = _RUNNERS.setdefault(model, [])
        pool[:] = [r for r in pool if r.busy or not r.stale(model)]  # moved models: rebuild
        runner = next((r for r in pool if not r.busy and r.requested == graphs
                       and r.capacity == capacity), None)
        if runner is None and len(pool) >= MAX_RUNNERS:
            free = [r for r in pool if not r.busy]
            if free:  # the least recently used gives way: memory stays bounded
                old = min(free, key=lambda r: r.last_used)
                pool.remove(old)
                old.close()
        if runner is None and len(pool) < MAX_RUNNERS:
            try:
                runner = StaticRunner(model, capacity, graphs=graphs)
            except StaticUnsupported as e:
                _warn_once(model, f"static cache unavailable ({e}): eager forwards")
                return EagerRunner(model)
            pool.append(runner)
        if runner is None:
            _warn_once(model, "every static runner of this model is busy: eager forwards for "
                       "concurrent requests")
            return EagerRunner(model)
        runner.busy = True
        _uses += 1
        runner.last_used = _uses
    try:
        runner.reserve(need)
    except Exception:
        runner.busy = False
        raise
    return runner


def release_runners(model) -> int:
    """Drop ``model``'s static runners and free their caches and graphs (one serving a request
    frees them when the request ends). Returns how many there were."""
    with _LOCK:
        pool = _RUNNERS.pop(model, [])
    for r in pool:
        r.close()
    return len(pool)


def graph_report(model) -> list[dict]:
    """Per static runner of ``model``: path, capacity, KV bytes, graphs and their memory."""
    return [{"path": r.path, "capacity": r.capacity, "kv_bytes": r.kv_bytes(),
             "graphs": sorted(r.graphs), "graph_bytes": r.graph_memory(),
             "captures": r.captures, "capture_s": r.capture_s}
            for r in _RUNNERS.get(model, [])]


def _warn_once(model, what: str) -> None:
    key = (id(model), what)
    if key not in _warned:
        _warned.add(key)
        log.warning("autospec: %s: %s", type(model).__name__, what)
