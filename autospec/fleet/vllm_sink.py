"""The store, from inside vLLM, off the hot path: finished requests' records and the
categoriser.

``StoreSink(url, ...)`` starts one daemon thread that opens the store (creating or migrating
it as ``open_store`` does), loads its feature key and "default" categoriser if one was
fitted, and then turns each finished request (``submit``: a queue put, never blocking; a full
queue drops and counts) into a ``RequestRecord`` handed to the store's own background writer.
Everything that fails — the store cannot be opened, a record is refused — is counted and
logged, never raised: generation goes on without telemetry. ``categorize`` answers from the
hot path with what the thread has loaded (nothing until it has).

Records have the shape of autospec's own traffic, so ``autospec stats / report / explain /
tune`` read them: the pair is the served model with no draft model (``NO_DRAFT``), path
"vllm" (the engine's step costs stay apart from transformers' forwards), policy
"autospec (vllm)"; per proposer its blocks and per-position counts, prompt lookup's trace
(computed by the writer); the engine's steps as ``target_s_by_n`` (a request that ran alone)
or ``target_s_by_bn`` ((B, tokens per request) → seconds).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from array import array
from functools import partial

log = logging.getLogger(__name__)

__all__ = ["StoreSink", "POLICY", "PATH"]

POLICY = "autospec (vllm)"  # the records' policy: what ran them
PATH = "vllm"  # the records' execution path: the engine's costs, kept apart
QUEUE = 4096


class StoreSink:
    """Finished requests → the store, on a thread of its own."""

    def __init__(self, url: str, *, target: str, dtype: str, hardware: str | None = None,
                 at_exit=None):
        self.url, self.target, self.dtype, self.hardware = url, target, dtype, hardware
        self.at_exit = at_exit  # called at the process's exit before the queue is written
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE)
        self.submitted = self.dropped = self.failures = self.written = 0
        self.last_error: str | None = None
        self.key = self.categorizer = None
        self.ready = threading.Event()  # the store is open (or failed to open)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autospec-vllm-store",
                                        daemon=True)
        self._thread.start()

    # -- from the hot path --------------------------------------------------------------------
    def submit(self, request) -> None:
        """A finished request (``vllm_speculator.Request``); never blocks."""
        self.submitted += 1
        try:
            self.queue.put_nowait(request)
        except queue.Full:
            self.dropped += 1

    def categorize(self, prompt: list[int]):
        """(category or None, predicted acceptance, feature blob), or None before the store
        is open; a categoriser's failure counts and gives no category."""
        key = self.key
        if key is None:
            return None
        try:
            from autospec.categorize.features import prompt_features

            blob = prompt_features(prompt, key)
            if self.categorizer is None:
                return None, None, blob
            category, alpha = self.categorizer.predict(blob)
            return category, alpha, blob
        except Exception as e:
            self._failed("categorise", e)
            return None

    def counts(self) -> dict:
        return {"submitted": self.submitted, "written": self.written, "dropped": self.dropped,
                "failures": self.failures, "last_error": self.last_error}

    # -- the thread ---------------------------------------------------------------------------
    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        self.last_error = f"{what}: {type(e).__name__}: {e}"
        if self.failures <= 3:
            log.warning("autospec: store %s failed (%d so far): %s", what, self.failures, e)

    def _open(self):
        from autospec.store import open_store

        store = open_store(self.url)
        try:
            from autospec.categorize.categorizer import Categorizer
            from autospec.categorize.features import FeatureKey

            self.key = FeatureKey(store.feature_key())
            found = Categorizer.load(store, "default")
            if found is not None:
                found.check_key(self.key)
                self.categorizer = found
                log.info("autospec: categorising vLLM's requests with %s v%s", found.name,
                         found.version)
        except Exception as e:  # no categories, still records
            self._failed("categoriser", e)
        return store

    def _run(self) -> None:
        try:
            store = self._open()
            writer = store.writer()
        except Exception as e:
            self._failed("open", e)
            self.ready.set()
            while not self._stop.is_set():  # drain, so the queue never fills the hot path's
                try:
                    self.queue.get(timeout=1.0)
                    self.dropped += 1
                except queue.Empty:
                    pass
            return
        # registered after the store's writer: exits run last-in first, so this one queues
        # the requests still running and writes the queue before the writer closes
        atexit.register(self._exit)
        self.ready.set()
        while True:
            try:
                req = self.queue.get(timeout=0.5)
            except queue.Empty:
                if self._stop.is_set():
                    break
                continue
            if req is None:
                break
            try:
                writer.submit(self.record(req))
                self.written += 1
            except Exception as e:
                self._failed("record", e)
        try:
            store.close()  # flushes the writer
        except Exception as e:
            self._failed("close", e)

    def _exit(self) -> None:
        try:
            if self.at_exit is not None:
                self.at_exit()
        except Exception as e:
            self._failed("exit", e)
        self.close(timeout=5.0)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop (tests; vLLM's process just exits)."""
        self._stop.set()
        try:
            self.queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    # -- the record -----------------------------------------------------------------------------
    def record(self, req):
        """The ``RequestRecord`` of one finished request."""
        from autospec.ngram import ngram_trace
        from autospec.store.record import (
            TRACE_GREEDY,
            TRACE_SAMPLED,
            PairInfo,
            ProposerRecord,
            RequestRecord,
        )
        from autospec.telemetry import NO_DRAFT

        if self.hardware is None:
            import torch

            from autospec.telemetry import hardware_name

            self.hardware = hardware_name(torch.device("cpu"))
        tokens = req.tokens
        new = len(tokens) - req.prompt_len
        proposers = {}
        for name, c in req.counts.items():
            trace = None
            settings = None
            if name == "ngram":
                settings = {"max_n": req.ngram.max_n, "min_n": req.ngram.min_n}
                trace = partial(ngram_trace, array("q", tokens), req.prompt_len,
                                max_n=req.ngram.max_n, min_n=req.ngram.min_n)
            proposers[name] = ProposerRecord(
                kind="lookup", blocks=c.blocks, proposed=c.proposed, accepted=c.accepted,
                proposed_per_position=list(c.proposed_per_position),
                accepted_per_position=list(c.accepted_per_position), seconds=c.seconds,
                trace=trace, settings=settings)
        alone = req.batch_max == 1
        by_n = {n: list(v) for (b, n), v in req.steps_by_bn.items() if alone}
        by_bn = None if alone else {bn: list(v) for bn, v in req.steps_by_bn.items()}
        limit = req.info.max_tokens
        greedy = req.info.greedy is not False
        return RequestRecord(
            pair=PairInfo(target=self.target, draft=NO_DRAFT, dtype=self.dtype,
                          hardware=self.hardware),
            category=req.category, policy=POLICY, greedy=greedy,
            prompt_tokens=req.prompt_len, new_tokens=new,
            iterations=len(req.k_schedule), proposers=proposers,
            proposer_schedule=list(req.proposer_schedule),
            k_schedule=bytes(min(k, 255) for k in req.k_schedule),
            accepted_schedule=bytes(min(a, 255) for a in req.accepted_schedule),
            wall_s=max(0.0, req.last_seen - req.started), prefill_s=0.0, draft_s=0.0,
            draft_forwards=0, target_s_by_n=by_n, trace_kind=TRACE_GREEDY if greedy
            else TRACE_SAMPLED, stop_reason="", created_at=req.started,
            max_new_tokens=limit if isinstance(limit, int) and limit >= max(1, new) else None,
            category_source=req.category_source, features=req.features,
            predicted_alpha=req.predicted_alpha, batch_size=req.batch_max,
            target_s_by_bn=by_bn, path=PATH)
