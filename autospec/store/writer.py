"""The background writer: records leave ``generate`` through a bounded queue.

Call order: ``submit(record)`` from any thread, any number of times; ``flush(timeout)`` to
wait until everything submitted so far is committed; ``close(timeout)`` to flush and stop.
An ``atexit`` hook flushes (bounded by ``atexit_timeout_s``) at interpreter exit.

``submit`` never blocks and never raises: a full queue drops the record and counts it in
``dropped`` (a warning is logged at most every ``warn_every_s``). A daemon thread takes up to
``batch`` records at a time and writes them in one transaction (pairs get-or-created and
cached, request rows inserted, ``category_stats`` updated). A failing database (locked, disk
full, unreachable: any SQLAlchemyError or OSError) never propagates: the writer logs, counts
``failures``, keeps ``last_error``, and retries the same batch with exponential backoff
(capped at ``max_backoff_s``) while ``submit`` keeps queueing (and dropping once full).
A record the database refuses for what it contains, or an invalid record (e.g. an empty
category), is isolated, counted in ``failures`` and ``rejected``, and skipped; it never
blocks the records behind it. A record's deferred work (``RequestRecord.finish``, e.g. the
n-gram trace) runs here, on the writer thread, when the record is validated; if it fails the
record counts as invalid.

Durability: a batch is durable once its transaction commits. Committed rows survive SIGKILL
of the writing process (SQLite in WAL mode with ``synchronous=NORMAL`` has written the commit
to the WAL file before COMMIT returns; only a power loss or OS crash can lose the last
commits; PostgreSQL commits are durable by its own settings). What a crash loses is at most
the records still in memory: up to ``max_queue`` queued plus the one batch (≤ ``batch``
records) in flight.

Processes: ``multiprocessing`` children exit without running ``atexit`` hooks, so call
``close()`` there. After ``os.fork`` the child's writers start over with an empty queue, new
connections and their own thread on the first ``submit`` (records queued in the parent stay
the parent's to write).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    OperationalError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from .database import Store
from .record import RequestRecord
from .write import validate_record, write_records

__all__ = ["StoreWriter", "WriterStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriterStats:
    submitted: int  # accepted into the queue
    written: int  # committed
    dropped: int  # refused by submit (queue full, or writer closed)
    failures: int  # failed write attempts plus rejected records
    rejected: int  # records skipped as invalid or refused by the database
    queued: int  # in memory now (queued + in flight)
    last_error: str | None


def _transient(exc: BaseException) -> bool:
    """Worth retrying as is (the database is unavailable), as opposed to a record it refuses."""
    if isinstance(exc, (OperationalError, DisconnectionError, PoolTimeoutError, OSError)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


_LIVE: weakref.WeakSet[StoreWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for w in list(_LIVE):
        w._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class StoreWriter:
    """Batches submitted records into transactions on a daemon thread (see module doc)."""

    def __init__(self, store: Store, *, max_queue: int = 10_000, batch: int = 256,
                 flush_interval_s: float = 0.5, max_backoff_s: float = 30.0,
                 warn_every_s: float = 60.0, atexit_timeout_s: float = 5.0) -> None:
        if max_queue < 1 or batch < 1:
            raise ValueError("max_queue and batch must be at least 1")
        self.store = store
        self.max_queue, self.batch = max_queue, batch
        self.flush_interval_s, self.max_backoff_s = flush_interval_s, max_backoff_s
        self.warn_every_s, self.atexit_timeout_s = warn_every_s, atexit_timeout_s
        self.submitted = self.written = self.dropped = self.failures = self.rejected = 0
        self.last_error: str | None = None
        self._closed = False
        self._reset()
        ref = weakref.ref(self)

        def _at_exit() -> None:
            w = ref()
            if w is not None:
                w.close(timeout=w.atexit_timeout_s)

        self._atexit = _at_exit
        atexit.register(_at_exit)
        store._writers.append(self)  # store.close() closes it

    def _reset(self) -> None:
        """Fresh queue and lock, no thread yet (construction, and in a forked child)."""
        self._cv = threading.Condition()
        self._queue: deque[tuple[int, RequestRecord]] = deque()
        self._seq = 0  # last sequence number handed out
        self._done = 0  # every record with seq ≤ _done is committed or discarded
        self._inflight = 0
        self._wake = False
        self._stopping = False
        self._draining = False  # closed from its own thread: write what is queued, then stop
        self._last_warn = {"drop": -1e9, "fail": -1e9}
        self._thread: threading.Thread | None = None  # started by the first submit
        _LIVE.add(self)

    def _forked(self) -> None:
        """In a forked child: the parent's queue, thread, connections and counts are not ours."""
        self.store.engine.dispose(close=False)
        self.submitted = self.written = self.dropped = self.failures = self.rejected = 0
        self._reset()

    # ---- producer side -------------------------------------------------------------------

    def submit(self, record: RequestRecord) -> bool:
        """Queue ``record``; False (and counted in ``dropped``) if the queue is full or the
        writer is closed. Never blocks on the database, never raises."""
        try:
            with self._cv:
                if self._thread is None and not self._closed:
                    thread = threading.Thread(target=self._run, name="autospec-store-writer",
                                              daemon=True)
                    thread.start()
                    self._thread = thread
                if self._closed or len(self._queue) + self._inflight >= self.max_queue:
                    self.dropped += 1
                    self._warn("drop", "store writer queue full (%d records): dropping; "
                               "%d dropped so far", self.max_queue, self.dropped)
                    return False
                self._seq += 1
                self._queue.append((self._seq, record))
                self.submitted += 1
                if len(self._queue) >= self.batch:
                    self._cv.notify_all()
            return True
        except Exception:  # the caller is generate(): nothing may escape
            log.exception("store writer: submit failed")
            return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record submitted so far is committed (or discarded as invalid);
        False if ``timeout`` (seconds) passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            target = self._seq
            if self._done < target:  # write what is queued now, not at the next interval
                self._wake = True
                self._cv.notify_all()
            while self._done < target:
                if self._thread is None or not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
            return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Flush (up to ``timeout`` seconds) and stop the thread; True if everything was
        written. Idempotent; later submits are dropped."""
        with self._cv:
            already = self._closed
            self._closed = True
        if already:
            return self.queued == 0
        atexit.unregister(self._atexit)
        with contextlib.suppress(ValueError):
            self.store._writers.remove(self)
        if self._thread is threading.current_thread():
            # closed on its own thread (a finaliser the garbage collector ran here, or a
            # record's deferred work): it cannot wait for itself, so it writes what is
            # queued and stops after the batch in hand
            with self._cv:
                self._draining = self._wake = True
                self._cv.notify_all()
            return False
        ok = self.flush(timeout)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0 if ok else 0.0)
        if not ok:
            log.warning("store writer closed with %d records unwritten (%s)", self.queued,
                        self.last_error or "timed out")
        return ok

    @property
    def queued(self) -> int:
        return len(self._queue) + self._inflight

    def stats(self) -> WriterStats:
        with self._cv:
            return WriterStats(self.submitted, self.written, self.dropped, self.failures,
                               self.rejected, self.queued, self.last_error)

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warn[kind] >= self.warn_every_s:
            self._last_warn[kind] = now
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

    # ---- the writer thread ---------------------------------------------------------------

    def _take(self) -> list[tuple[int, RequestRecord]] | None:
        """The next batch, waiting for it to fill (or the interval / a flush); None to stop."""
        with self._cv:
            waited_since = time.monotonic()
            while True:
                if self._stopping or (self._draining and not self._queue):
                    return None  # close() flushed already, gave up waiting, or drained
                if self._queue and (len(self._queue) >= self.batch or self._wake
                                    or time.monotonic() - waited_since
                                    >= self.flush_interval_s):
                    break
                if not self._queue:
                    waited_since = time.monotonic()
                self._cv.wait(self.flush_interval_s)
            n = min(self.batch, len(self._queue))
            items = [self._queue.popleft() for _ in range(n)]
            self._inflight = n
            if not self._queue and not self._draining:
                self._wake = False
            return items

    def _finish(self, items: list[tuple[int, RequestRecord]], written: int) -> None:
        with self._cv:
            self.written += written
            self._inflight = 0
            self._done = items[-1][0]
            self._cv.notify_all()

    def _fail(self, exc: BaseException, what: str) -> None:
        with self._cv:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        self._warn("fail", "store writer: %s failed (%s); %d failures so far", what,
                   self.last_error, self.failures)

    def _write(self, records: list[RequestRecord]) -> None:  # records: validated
        with self.store.begin() as session:
            used = write_records(session, records, self.store.pair_ids, validated=True)
        self.store.pair_ids.update(used)  # only after the commit: these rows exist now

    def _valid(self, items: list[tuple[int, RequestRecord]]) -> list[RequestRecord]:
        """The validated records (their deferred work, ``finish``, done); the invalid ones,
        and those whose deferred work failed, counted in ``failures`` and ``rejected``."""
        good = []
        for _, rec in items:
            try:
                good.append(validate_record(rec))
            except Exception as exc:
                self._fail(exc, "an invalid record")
                with self._cv:
                    self.rejected += 1
        return good

    def _write_batch(self, records: list[RequestRecord]) -> int:
        """Commit ``records``; returns how many were written. Retries transient failures
        until they succeed (or the writer stops); isolates records the database refuses."""
        backoff = min(0.05, self.max_backoff_s)
        while True:
            try:
                self._write(records)
                return len(records)
            except Exception as exc:
                if not _transient(exc):
                    return self._write_one_by_one(records, exc)
                self._fail(exc, f"writing {len(records)} records")
            with self._cv:  # back off; a flush wakes us early, close() stops retrying
                if self._stopping:
                    return 0
                self._cv.wait(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def _write_one_by_one(self, records: list[RequestRecord], first: BaseException) -> int:
        self._fail(first, f"writing {len(records)} records")
        self.store.pair_ids.clear()  # in case a cached pair row vanished
        if len(records) == 1:
            with self._cv:
                self.rejected += 1
            return 0
        return sum(self._write_batch([r]) for r in records)

    def _run(self) -> None:
        while True:
            items = None
            try:
                items = self._take()
                if items is None:
                    return
                records = self._valid(items)
                self._finish(items, self._write_batch(records) if records else 0)
            except Exception as exc:  # a bug here must not kill the thread silently
                log.exception("store writer: unexpected error; %d records lost",
                              len(items or ()))
                with self._cv:
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                if items:
                    self._finish(items, 0)
                time.sleep(min(1.0, self.max_backoff_s))

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
