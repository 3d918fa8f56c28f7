"""The background writer: flush and close, interpreter exit, a locked database, a full queue.
(Invalid records and the writer under several processes: test_store, test_store_concurrency.)"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autospec.store import open_store

from test_store import BACKENDS, assert_stats_match, count_requests, fresh_url, make_record


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_flushes_is_idempotent_and_later_submits_are_dropped(backend, tmp_path):
    url, cleanup = fresh_url(backend, tmp_path)
    rng = random.Random(10)
    try:
        with open_store(url) as store:
            w = store.writer(flush_interval_s=60)  # only a flush or a full batch writes
            for _ in range(10):
                assert w.submit(make_record(rng))
            assert w.close(timeout=10) and w.close() and count_requests(store) == 10
            assert not w.submit(make_record(rng))
            assert w.stats().dropped == 1
    finally:
        cleanup()


def test_closed_on_its_own_thread_it_writes_what_is_queued_and_stops(tmp_path):
    """A controller's finaliser can run on the writer's thread (the garbage collector runs
    where it runs): close() there cannot wait for itself; it drains and stops, at once."""
    rng = random.Random(12)
    with open_store(str(tmp_path / "own.db")) as store:
        w = store.writer(flush_interval_s=60, batch=2)
        recs = [make_record(rng) for _ in range(5)]
        closed = []

        def close_here(rec):  # deferred work: runs on the writer's thread
            t0 = time.monotonic()
            closed.append(w.close(timeout=10))
            closed.append(time.monotonic() - t0)

        recs[0].finish = close_here
        for r in recs:
            assert w.submit(r)
        w._thread.join(timeout=30)
        assert not w._thread.is_alive() and count_requests(store) == 5
        assert closed[0] is False and closed[1] < 5  # never waited on itself
        assert w.stats().failures == 0 and not w.submit(make_record(rng))


def test_interpreter_exit_flushes_the_writer(tmp_path):
    db = tmp_path / "exit.db"
    code = textwrap.dedent(f"""
        import random, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store import make_record
        from autospec.store import open_store
        w = open_store({str(db)!r}).writer(flush_interval_s=60)
        rng = random.Random(11)
        for _ in range(100):
            assert w.submit(make_record(rng))
        # no close(): the atexit hook flushes
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with open_store(str(db)) as st:
        assert count_requests(st) == 100


def test_a_locked_database_is_retried_counted_and_never_raises(tmp_path):
    db = tmp_path / "locked.db"
    st = open_store(str(db), busy_timeout_s=0.05)
    w = st.writer(max_queue=5, batch=2, flush_interval_s=0.01, max_backoff_s=0.1,
                  warn_every_s=0.2)
    locker = sqlite3.connect(db, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    rng = random.Random(12)
    recs = [make_record(rng) for _ in range(12)]
    accepted = [r for r in recs if w.submit(r)]
    assert len(accepted) == 5 and w.stats().dropped == 7
    deadline = time.monotonic() + 5
    while w.stats().failures < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    st_locked = w.stats()
    assert st_locked.failures >= 3 and st_locked.written == 0
    assert "locked" in st_locked.last_error
    assert not w.flush(0.2)  # still locked: flush times out instead of raising
    locker.execute("ROLLBACK")
    locker.close()
    assert w.flush(10)
    assert w.stats().written == 5 and w.close()
    with st.session() as s:
        assert_stats_match(s, accepted)
    st.close()


def test_close_gives_up_after_its_timeout_when_the_database_stays_locked(tmp_path):
    db = tmp_path / "stuck.db"
    st = open_store(str(db), busy_timeout_s=0.05)
    w = st.writer(max_backoff_s=0.1)
    locker = sqlite3.connect(db, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    w.submit(make_record(random.Random(13)))
    t0 = time.monotonic()
    assert not w.close(timeout=0.5)
    assert time.monotonic() - t0 < 3
    locker.execute("ROLLBACK")
    locker.close()
    st.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_writes_through_its_own_writer(tmp_path):
    with open_store(tmp_path / "fork.db") as store:
        w = store.writer()
        rng = random.Random(15)
        assert w.submit(make_record(rng)) and w.flush(10)
        w.submit(make_record(rng))  # queued in the parent when it forks: the parent's to write
        pid = os.fork()
        if pid == 0:  # the child: its own queue, thread and connections
            ok = all(w.submit(make_record(rng)) for _ in range(5)) and w.close(10)
            os._exit(0 if ok and w.stats().written == 5 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert w.close(10) and w.stats().written == 2
        assert count_requests(store) == 7

