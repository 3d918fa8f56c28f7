"""Stores this user may read but not write: a WAL store in another user's directory, on
read-only media or in a snapshot is read in full by the reading commands; a write-ahead log
SQLite cannot apply there is named, not silently skipped; a writing open says the store is
read-only. Real files and real permissions: as root (CI), chmod does not stop writes, so the
reader is another user (`nobody`, in a forked child); otherwise the files are made read-only."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import shutil
import sqlite3
import stat
import tempfile
import traceback
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from autospec.cli import main
from autospec.store import StoreError, StoreReadOnly, open_store, queries

from test_store import assert_stats_match, fresh_url, make_record

NOBODY = 65534  # the unprivileged user and group of Debian and most distributions
ROOT = os.geteuid() == 0


def _as_reader(fn):
    """``fn()`` run by a user who may read the test's files but not write them (see
    ``read_only_dir``): as root, in a forked child that becomes `nobody`; else here. Returns
    what ``fn`` returns; its exception fails the test with its traceback."""
    if not ROOT:
        return fn()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(rfd)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = ("ok", fn())
        except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test
            result = ("error", traceback.format_exc())
        try:
            with os.fdopen(wfd, "wb") as f:
                pickle.dump(result, f)
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    status, value = pickle.loads(data)
    if status != "ok":
        pytest.fail(f"the reader without write access failed:\n{value}")
    return value


@pytest.fixture
def read_only_dir():
    """(directory, lock): a directory the reader can reach; ``lock()`` makes it and its files
    read-only for the reader (root: they belong to root, mode 755/644, and the reader is
    `nobody`; otherwise mode 555/444)."""
    top = Path(tempfile.mkdtemp(prefix="autospec-ro-"))
    top.chmod(0o755)
    if ROOT and any(not p.stat().st_mode & stat.S_IXOTH for p in top.parents):
        shutil.rmtree(top)
        pytest.skip(f"{top.parent} is not reachable by another user (set TMPDIR)")
    directory = top / "store"
    directory.mkdir()
    # everything the reader runs is imported now: `nobody` cannot read this interpreter's files
    warm = top / "warm.db"
    with open_store(warm) as st:
        st.write(_records(90, 1, "warm"))
    assert _cli("stats", "--db", str(warm))[0] == 0

    def lock() -> None:
        for f in directory.iterdir():
            f.chmod(0o644 if ROOT else 0o444)
        directory.chmod(0o755 if ROOT else 0o555)

    yield directory, lock
    directory.chmod(0o755)
    shutil.rmtree(top)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _records(seed: int, n: int, category: str):
    return [make_record(random.Random(seed + i), category=category) for i in range(n)]


def _read_all(path: Path, records) -> str | None:
    """Open ``path`` read-only, check it holds exactly ``records``; its note on what it
    could not read."""
    with open_store(path, read_only=True) as st, st.session() as s:
        assert_stats_match(s, records)
        return st.stale


def test_a_wal_store_in_a_directory_this_user_cannot_write_is_read_in_full(read_only_dir):
    directory, lock = read_only_dir
    path = directory / "autospec.db"
    records = _records(0, 5, "code")
    with open_store(path) as st:
        st.write(records)
    with contextlib.closing(sqlite3.connect(path)) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert os.listdir(directory) == ["autospec.db"]  # closed cleanly: no -wal, no -shm
    lock()

    def read():
        return _read_all(path, records), _cli("stats", "--db", str(path)), \
            sorted(os.listdir(directory))

    stale, (code, out, err), files = _as_reader(read)
    assert stale is None
    assert code == 0 and err == "", err
    assert "code" in out
    assert files == ["autospec.db"]  # nothing created beside it


def test_a_snapshot_of_a_live_store_is_read_with_its_log(read_only_dir):
    """A copy taken while a server writes holds -wal and -shm: SQLite reads the log through
    them, even where it cannot write them — nothing is missed."""
    directory, lock = read_only_dir
    live = directory.parent / "live.db"
    records = _records(10, 6, "chat")
    with open_store(live) as st:
        st.write(records)  # committed to the log, not yet checkpointed: the store is open
        assert Path(f"{live}-wal").stat().st_size > 0
        for suffix in ("", "-wal", "-shm"):
            shutil.copyfile(f"{live}{suffix}", directory / f"autospec.db{suffix}")
    lock()
    assert _as_reader(lambda: _read_all(directory / "autospec.db", records)) is None


def test_a_log_this_user_cannot_apply_is_named_with_what_to_do(read_only_dir):
    """A copy holding the -wal but not the -shm, read-only: SQLite can only read the main
    file (immutable), so the commits in the log are missing — one warning line says which
    file holds them and how to read them, instead of stale figures shown as current."""
    directory, lock = read_only_dir
    live = directory.parent / "live.db"
    checkpointed, logged = _records(20, 4, "code"), _records(30, 3, "code")
    with open_store(live) as st:
        st.write(checkpointed)
        with st.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        st.write(logged)  # in the log only
        shutil.copyfile(live, directory / "autospec.db")
        shutil.copyfile(f"{live}-wal", directory / "autospec.db-wal")
    path = directory / "autospec.db"
    lock()

    def read():
        return _read_all(path, checkpointed), _cli("stats", "--db", str(path))

    stale, (code, out, err) = _as_reader(read)
    wal = f"{path}-wal"
    assert stale is not None and wal in stale and "not shown" in stale
    assert code == 0 and "code" in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autospec: warning: ") and wal in lines[0]
    assert "copy" in lines[0]  # what to do
    # the advice works: a copy in a writable directory is read with its log
    copy = directory.parent / "copy"
    copy.mkdir()
    shutil.copyfile(path, copy / "autospec.db")
    shutil.copyfile(wal, copy / "autospec.db-wal")
    assert _read_all(copy / "autospec.db", checkpointed + logged) is None


def test_a_writing_open_of_a_store_this_user_cannot_write_says_it_is_read_only(read_only_dir):
    directory, lock = read_only_dir
    path = directory / "autospec.db"
    with open_store(path) as st:
        st.write(_records(40, 2, "code"))
    before = path.read_bytes()
    lock()

    def write():
        try:
            open_store(path).close()
        except StoreReadOnly as e:
            return str(e)
        return None

    message = _as_reader(write)
    assert message is not None and "cannot be written by this process" in message
    assert path.read_bytes() == before
    assert os.listdir(directory) == ["autospec.db"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_url_that_opens_read_only_is_refused_by_writers_and_read_by_readers(backend,
                                                                              tmp_path):
    """SQLite: the caller's own ``mode=ro`` URI; PostgreSQL: sessions that are read-only
    (a standby, or ``default_transaction_read_only``). A writing open says so before it
    writes anything; a reading open reads it."""
    url, cleanup = fresh_url(backend, tmp_path)
    try:
        records = _records(50, 3, "chat")
        with open_store(url) as st:
            st.write(records)
        if backend == "sqlite":
            read_only = f"sqlite:///file:{make_url(url).database}?mode=ro&uri=true"
        else:
            u = make_url(url)
            read_only = u.update_query_dict({"options": f"{u.query['options']} -c "
                                             "default_transaction_read_only=on"})
            read_only = read_only.render_as_string(hide_password=False)
        with pytest.raises(StoreReadOnly, match="cannot be written by this process"):
            open_store(read_only)
        with open_store(read_only, read_only=True) as st, st.session() as s:
            assert_stats_match(s, records)
            assert st.read_only
            with pytest.raises(StoreError, match="opened read-only"):
                st.writer()
        with open_store(url) as st, st.session() as s:
            assert len(queries.recent_requests(s, limit=10)) == 3  # nothing else was written
    finally:
        cleanup()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_reading_commands_refuse_a_newer_schema_in_one_line_and_change_nothing(backend,
                                                                               tmp_path):
    from sqlalchemy import create_engine, text

    from autospec.store.tables import VERSION_TABLE

    url, cleanup = fresh_url(backend, tmp_path)
    try:
        with open_store(url) as st:
            st.write(_records(60, 2, "code"))
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'"))
        engine.dispose()
        path = Path(make_url(url).database) if backend == "sqlite" else None
        before = path.read_bytes() if path else None
        for command in (["stats"], ["report"], ["explain", "--request", "1"]):
            code, out, err = _cli(*command, "--db", url)
            assert code == 2 and out == "", (command, out)
            assert err.count("\n") == 1 and err.startswith("autospec: error: "), err
            assert "newer autospec" in err and "upgrade autospec" in err
        if path:
            assert path.read_bytes() == before
        engine = create_engine(url)
        with engine.connect() as conn:
            assert conn.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}")) == "9999_future"
        engine.dispose()
    finally:
        cleanup()
