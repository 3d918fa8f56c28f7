"""Several writer processes, a concurrent reader, and SIGKILL, on SQLite and PostgreSQL.

Children are started with the ``spawn`` method (no inherited connections or threads) and
import their code from this module and ``test_store``."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sqlite3
import time
from dataclasses import asdict

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from autospec.store import open_store, queries, write_records
from autospec.store.tables import CategoryStat, Request

from test_store import BACKENDS, CATEGORIES, LONG, assert_stats_match, fresh_url, make_record

SPAWN = mp.get_context("spawn")
PROCS, PER_PROC = 4, 500


def _records(seed: int, n: int):
    """Mostly short categories, as traffic has; a few of 10k characters."""
    rng = random.Random(seed)
    pick = lambda: LONG if rng.random() < 0.02 else rng.choice(CATEGORIES[:3])  # noqa: E731
    return [make_record(rng, category=pick()) for _ in range(n)]


def _count_and_total(session: Session) -> tuple[int, int]:
    """Rows in requests, and the requests category_stats account for (one snapshot)."""
    rows = session.scalar(select(func.count()).select_from(Request))
    total = session.scalar(select(func.coalesce(func.sum(CategoryStat.requests), 0)))
    return rows, int(total)


def _snapshot(store) -> Session:
    """A read session seeing one snapshot for all its statements (SQLite's deferred
    transaction already does; PostgreSQL's default READ COMMITTED does not)."""
    if store.dialect == "postgresql":
        return Session(store.engine.execution_options(isolation_level="REPEATABLE READ"))
    return Session(store.engine)


# ---- child processes ---------------------------------------------------------------------


def _writer_child(url: str, seed: int, n: int, batch: int, start, out) -> None:
    records = _records(seed, n)
    store = open_store(url)  # several children migrate an empty database at once
    writer = store.writer(batch=batch)
    start.wait(timeout=120)  # all writers and the reader ready: the timing covers concurrent writing
    t0 = time.time()
    for r in records:
        writer.submit(r)
    writer.close(timeout=120)  # multiprocessing children skip atexit hooks
    out.put(("writer", seed, t0, time.time(), asdict(writer.stats())))
    store.close()


def _reader_child(url: str, stop, out, start=None) -> None:
    store = open_store(url)
    reads = errors = inconsistent = backwards = last = 0
    error = None
    if start is not None:  # ready before the writers start (else a loaded machine can start
        start.wait(timeout=120)  # it after they are done, and it reads nothing concurrently)
    while not stop.is_set():
        try:
            with _snapshot(store) as s, s.begin():
                rows, total = _count_and_total(s)
                queries.category_summaries(s)
            inconsistent += rows != total
            backwards += rows < last
            last = rows
            reads += 1
        except Exception as exc:  # counted, and the test fails on any
            errors += 1
            error = repr(exc)
        time.sleep(0.005)
    out.put(("reader", reads, errors, inconsistent, backwards, error))
    store.close()


def _killable_child(url: str, seed: int, conn) -> None:
    """Writes batches of 20 in a loop; after each commit sends the batch's last id."""
    store = open_store(url)
    rng = random.Random(seed)
    while True:
        batch = [make_record(rng) for _ in range(20)]
        with store.begin() as s:
            write_records(s, batch)
            last = s.scalar(select(func.max(Request.id)))
        conn.send(last)  # only after the commit returned


def _killable_writer_child(url: str, seed: int) -> None:
    """Submits to a StoreWriter as fast as it can, forever."""
    store = open_store(url)
    writer = store.writer(batch=16, flush_interval_s=0.01)
    rng = random.Random(seed)
    while True:
        writer.submit(make_record(rng))
        time.sleep(0.0005)


# ---- tests -------------------------------------------------------------------------------


def run_writers_and_reader(url: str, procs: int, per_proc: int, batch: int = 64) -> dict:
    out, stop, start = SPAWN.Queue(), SPAWN.Event(), SPAWN.Barrier(procs + 1)
    reader = SPAWN.Process(target=_reader_child, args=(url, stop, out, start))
    writers = [SPAWN.Process(target=_writer_child,
                             args=(url, seed, per_proc, batch, start, out))
               for seed in range(procs)]
    reader.start()
    for p in writers:
        p.start()
    results = [out.get(timeout=180) for _ in writers]
    stop.set()
    reader_result = out.get(timeout=60)
    for p in (*writers, reader):
        p.join(timeout=30)
        assert p.exitcode == 0
    return {"writers": results, "reader": reader_result}


@pytest.mark.parametrize("backend", BACKENDS)
def test_writer_processes_lose_nothing_while_a_reader_reads(backend, tmp_path, capsys):
    url, cleanup = fresh_url(backend, tmp_path)
    try:
        res = run_writers_and_reader(url, PROCS, PER_PROC)
        for _, seed, _, _, stats in res["writers"]:
            counts = (stats["written"], stats["dropped"], stats["failures"])
            assert counts == (PER_PROC, 0, 0), f"writer {seed}: {stats}"
        _, reads, errors, inconsistent, backwards, error = res["reader"]
        assert (errors, inconsistent, backwards) == (0, 0, 0), error
        assert reads > 0
        with open_store(url) as store, store.session() as s:
            assert _count_and_total(s) == (PROCS * PER_PROC, PROCS * PER_PROC)
            expected = [r for seed in range(PROCS) for r in _records(seed, PER_PROC)]
            assert_stats_match(s, expected, check_times=False)
        start = min(t0 for _, _, t0, _, _ in res["writers"])
        end = max(t1 for _, _, _, t1, _ in res["writers"])
        with capsys.disabled():
            print(f"\n[store {backend}] {PROCS} processes x {PER_PROC} records: "
                  f"{PROCS * PER_PROC / (end - start):.0f} records/s "
                  f"({end - start:.2f} s; reader: {reads} consistent snapshots)")
    finally:
        cleanup()


def _sqlite_integrity(url: str) -> str:
    with sqlite3.connect(make_url(url).database) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_loses_no_committed_batch(backend, tmp_path):
    url, cleanup = fresh_url(backend, tmp_path)
    try:
        open_store(url).close()
        ours, theirs = SPAWN.Pipe(duplex=False)
        child = SPAWN.Process(target=_killable_child, args=(url, 1, theirs))
        child.start()
        theirs.close()
        reported = []
        while len(reported) < 8:
            assert ours.poll(60), "the child never committed"
            reported.append(ours.recv())
        time.sleep(random.Random(2).uniform(0, 0.02))  # somewhere inside a later batch
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
        assert child.exitcode == -signal.SIGKILL
        while ours.poll(0.1):  # whatever was committed and sent before the kill
            try:
                reported.append(ours.recv())
            except EOFError:
                break
        if backend == "sqlite":
            assert _sqlite_integrity(url) == "ok"
        last = max(reported)
        with open_store(url) as store, store.session() as s:
            present = set(s.scalars(select(Request.id).where(Request.id <= last)))
            assert set(reported) <= present
            assert present == set(range(1, last + 1))  # batches are whole, ids dense
            rows, total = _count_and_total(s)
            assert rows == total and rows >= last  # the statistics commit with their rows
    finally:
        cleanup()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_of_a_process_using_the_writer_leaves_a_consistent_store(backend, tmp_path):
    url, cleanup = fresh_url(backend, tmp_path)
    try:
        store = open_store(url)
        child = SPAWN.Process(target=_killable_writer_child, args=(url, 3))
        child.start()
        deadline = time.monotonic() + 60
        while True:  # wait until the child's writer has committed a few batches
            with store.session() as s:
                if _count_and_total(s)[0] >= 64 or time.monotonic() > deadline:
                    break
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
        store.close()
        if backend == "sqlite":
            assert _sqlite_integrity(url) == "ok"
        with open_store(url) as store, store.session() as s:
            rows, total = _count_and_total(s)
            assert rows >= 64 and rows == total
    finally:
        cleanup()
