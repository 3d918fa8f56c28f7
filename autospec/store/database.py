"""Opening a store: URL → engine, schema upgrade, and the errors a user can act on.

``open_store(None)`` is a SQLite file in the cache directory; a bare path is a SQLite file;
anything with ``://`` is a SQLAlchemy URL (``postgresql+psycopg://user:pw@host/db``).

SQLite is set up for several writer processes and concurrent readers: WAL journal,
``synchronous=NORMAL`` (a commit survives a crash of the process; only power loss can lose the
last commits), a busy timeout, foreign keys on, and write transactions that start with
``BEGIN IMMEDIATE`` (pysqlite's own transaction handling is switched off), so writers queue on
the lock instead of failing to upgrade a read lock with SQLITE_BUSY. Readers use a deferred
``BEGIN`` and never wait on writers.

A damaged SQLite file (a page overwritten on disk: "database disk image is malformed", "file
is not a database", text that is not the UTF-8 written there) is ``StoreDamaged``, a
``StoreError`` naming the file and what to do, whether it shows when the store opens or in a
later session: retrying or migrating cannot mend it.

Errors come in two kinds. A plain ``StoreError``: the URL reaches no usable database (it is
malformed, names an unknown kind or a driver not installed, a directory, a path whose
directory cannot be created, a server that does not answer) — the fix is in the caller's
configuration. ``StoreUnusable``: the URL names a store that this autospec cannot write as it
is — ``StoreTooNew`` (written by a newer autospec), ``StoreReadOnly`` (this process may not
write it), ``StoreDamaged``. Serving goes on without telemetry for the second kind
(``autospec.controller``); commands refuse both with the message.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import shlex
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from .record import PairInfo

__all__ = ["Store", "StoreError", "StoreUnusable", "StoreTooNew", "StoreReadOnly", "StoreDamaged",
           "open_store", "default_url", "cache_dir"]

log = logging.getLogger(__name__)

DB_FILENAME = "autospec.db"
_EXAMPLES = ("e.g. sqlite:///path/to/autospec.db, a plain file path, or "
             "postgresql+psycopg://user:password@host:5432/dbname")
_PG_LOCK_ID = 0x6175746F73706563 & 0x7FFFFFFFFFFFFFFF  # "autospec": serialises migrations


class StoreError(ValueError):
    """The store cannot be opened or used as asked; the message says why and what to do."""

    url: str | None = None  # the store's URL, password hidden, where the error names one


class StoreUnusable(StoreError):
    """A store is there, but this autospec cannot write it as it is (see the subclasses)."""


class StoreTooNew(StoreUnusable):
    """The store was written by a newer autospec (a schema revision this one does not know)."""


class StoreReadOnly(StoreUnusable):
    """This process may read the store but not write it (permissions, read-only media or
    session, or a store opened read-only)."""


class StoreDamaged(StoreUnusable):
    """The store's SQLite file is damaged on disk; the message names it and how to recover."""


# what SQLite says of a damaged file (SQLITE_CORRUPT, SQLITE_NOTADB), and what pysqlite says
# when a damaged page holds bytes that are not the UTF-8 text autospec wrote there
_DAMAGE = ("database disk image is malformed", "file is not a database",
           "could not decode to utf-8")


def _sqlite_file(u: URL) -> str:
    """The file path of a SQLite URL, also when it was opened as a ``file:…?mode=ro`` URI."""
    from urllib.parse import unquote

    db = u.database or ""
    if db.startswith("file:"):
        db = unquote(db[len("file:"):].partition("?")[0])
    return db


def damage_of(exc: BaseException, u: URL) -> StoreDamaged | None:
    """``exc`` as a StoreDamaged for the SQLite store at ``u`` when it says the file is
    damaged; None for any other error (and for any other database)."""
    if u.get_backend_name() != "sqlite" or _sqlite_memory(u):
        return None
    orig = getattr(exc, "orig", None) or exc
    if not isinstance(orig, sqlite3.Error):
        return None
    detail = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    if not any(d in detail.lower() for d in _DAMAGE):
        return None
    detail = detail.partition(" with text ")[0]  # not the damaged bytes themselves
    path = _sqlite_file(u)
    return StoreDamaged(
        f"the store {path} is damaged ({detail}): restore it from a backup, or save what "
        f"is still readable with `sqlite3 {shlex.quote(path)} .recover | sqlite3 recovered.db` "
        "(sqlite3 3.29 or later) and use recovered.db as the store")


def cache_dir() -> Path:
    """autospec's cache directory: $AUTOSPEC_CACHE, else $XDG_CACHE_HOME/autospec, else
    ~/.cache/autospec. The one definition (torch-free; autospec.pairs uses it too)."""
    if os.environ.get("AUTOSPEC_CACHE"):
        return Path(os.environ["AUTOSPEC_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "autospec"
    return Path.home() / ".cache" / "autospec"


def default_url() -> str:
    return f"sqlite:///{cache_dir() / DB_FILENAME}"


def _resolve(url: str | os.PathLike | None) -> URL:
    if url is None:
        url = default_url()
    elif isinstance(url, str) and not url.strip():
        raise StoreError(f"empty store URL; give a file path or a URL ({_EXAMPLES})")
    elif isinstance(url, os.PathLike) or (isinstance(url, str) and "://" not in url):
        url = f"sqlite:///{Path(url).expanduser().absolute()}"
    if not isinstance(url, str):
        raise StoreError(f"store URL must be a string or path, got {type(url).__name__}")
    try:
        return make_url(url)
    except (ArgumentError, ValueError) as exc:
        shown = re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)  # never echo a password
        raise StoreError(f"malformed store URL {shown!r}: {exc}; expected {_EXAMPLES}") from None


def _sqlite_memory(u: URL) -> bool:
    db = u.database or ""
    return db in ("", ":memory:") or "mode=memory" in db or u.query.get("mode") == "memory"


def _prepare_sqlite_file(u: URL) -> None:
    """Create the database file's directory (friendlier than 'unable to open database file')."""
    if _sqlite_memory(u) or u.query.get("uri") == "true" or (u.database or "").startswith("file:"):
        return
    path = Path(u.database).expanduser()
    if path.is_dir():
        raise StoreError(f"store path {str(path)!r} is a directory; give a file path inside it, "
                         f"e.g. {str(path / DB_FILENAME)!r}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create the directory for the store file {str(path)!r}: "
                         f"{exc}; choose a writable location") from None


def _install_sqlite_events(engine: Engine) -> None:
    # per-connection settings; none writes to the file (WAL does: ensure_wal, after the check)
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (see _on_begin)
        cur = dbapi_conn.cursor()
        try:
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("autospec_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _make_engine(u: URL, busy_timeout_s: float, read_only: bool = False) -> Engine:
    backend = u.get_backend_name()
    kwargs: dict[str, Any] = {}
    if backend == "sqlite" and read_only:  # u opens the file read-only (readonly.py)
        kwargs.update(connect_args={"timeout": busy_timeout_s, "check_same_thread": False})
    elif backend == "sqlite":
        _prepare_sqlite_file(u)
        if _sqlite_memory(u):  # one connection, shared by threads (and serialised by Store)
            kwargs.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
        else:
            kwargs.update(connect_args={"timeout": busy_timeout_s, "check_same_thread": False})
    elif backend == "postgresql":
        has = importlib.util.find_spec
        if u.drivername == "postgresql" and has("psycopg2") is None and has("psycopg"):
            u = u.set(drivername="postgresql+psycopg")  # plain postgresql:// means psycopg2
        if "connect_timeout" not in u.query:
            kwargs["connect_args"] = {"connect_timeout": max(1, int(busy_timeout_s))}
        if read_only:  # the server refuses any write in these sessions
            ro = "-c default_transaction_read_only=on"
            opts = u.query.get("options")
            u = u.update_query_dict({"options": f"{opts} {ro}" if opts else ro})
        kwargs["pool_pre_ping"] = True
    try:
        engine = create_engine(u, **kwargs)
    except NoSuchModuleError:
        raise StoreError(f"unknown database kind {u.drivername!r} in store URL; expected "
                         f"{_EXAMPLES}") from None
    except ImportError as exc:
        hint = ("pip install 'autospec[postgres]' and use postgresql+psycopg://"
                if backend == "postgresql" else "install that driver, or use SQLite")
        raise StoreError(f"the database driver for {u.drivername!r} is not installed "
                         f"({exc}); {hint}") from None
    except (ArgumentError, TypeError, ValueError) as exc:
        raise StoreError(f"bad store URL {u.render_as_string(hide_password=True)!r}: "
                         f"{exc}") from None
    if backend == "sqlite":
        _install_sqlite_events(engine)
    return engine


def ensure_wal(engine: Engine) -> None:
    """Switch a SQLite file to WAL (persistent: once per file); no-op elsewhere."""
    if engine.dialect.name != "sqlite" or _sqlite_memory(engine.url):
        return
    raw = engine.raw_connection()  # journal_mode cannot change inside a transaction
    try:
        cur = raw.cursor()
        if cur.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            mode = cur.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                log.warning("SQLite store %s stays in %s journal mode (WAL unsupported here, "
                            "e.g. a network filesystem)", engine.url.database, mode)
        cur.close()
    finally:
        raw.close()


class Store:
    """An open store: an engine with the schema at the current revision.

    ``with store.session() as s:`` gives a read session (the caller commits if it writes);
    ``with store.begin() as s:`` a write transaction that commits on success (on SQLite it
    holds the write lock from its first statement). Query functions in
    ``autospec.store.queries`` take such a session. ``store.writer()`` starts the background
    writer the runtime submits records to. ``feature_key()`` is the secret its prompt
    features are keyed by (``autospec.store.keys``). Thread-safe; ``close()`` closes writers
    and the engine's connections.

    ``read_only``: opened by ``open_store(read_only=True)``; it takes no writer. ``stale``:
    None, or the one line saying which commits this read-only view cannot show (a SQLite
    write-ahead log it cannot apply, ``autospec/store/readonly.py``).
    """

    def __init__(self, engine: Engine, url: URL | None = None, *, read_only: bool = False,
                 stale: str | None = None) -> None:
        self.engine = engine
        self._u = url or engine.url
        self.url = self._u.render_as_string(hide_password=True)
        self.read_only, self.stale = read_only, stale
        self._key: bytes | None = None
        self._key_lock = threading.Lock()
        self.dialect = engine.dialect.name
        self.pair_ids: dict[PairInfo, int] = {}  # committed pair rows, shared by writers
        memory = self.dialect == "sqlite" and _sqlite_memory(engine.url)
        self._serial = threading.RLock() if memory else None  # one shared connection
        self._read = sessionmaker(engine, expire_on_commit=False)
        write_engine = engine.execution_options(autospec_write=True)
        self._write = sessionmaker(write_engine, expire_on_commit=False)
        self._writers: list[Any] = []  # StoreWriters register here; close() closes them
        self.closed = False

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @contextlib.contextmanager
    def _serialised(self) -> Iterator[None]:
        if self._serial is None:
            yield
        else:
            with self._serial:
                yield

    @contextlib.contextmanager
    def _damage_named(self) -> Iterator[None]:
        """A damaged file's error as StoreDamaged (see ``damage_of``); others as they are."""
        try:
            yield
        except (SQLAlchemyError, sqlite3.Error) as exc:
            damaged = damage_of(exc, self.engine.url)
            if damaged is None:
                raise
            raise damaged from exc

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        with self._serialised(), self._damage_named(), self._read() as session:
            yield session

    @contextlib.contextmanager
    def begin(self) -> Iterator[Session]:
        with self._serialised(), self._damage_named(), self._write.begin() as session:
            yield session

    def write(self, records: Any) -> int:
        """Write records now, in one transaction (ValueError for an invalid one, e.g. an
        empty category; SQLAlchemyError from the database). The runtime uses ``writer()``."""
        from .write import validate_record, write_records

        records = [validate_record(r) for r in records]  # refuse before taking any lock
        with self.begin() as session:
            used = write_records(session, records, self.pair_ids, validated=True)
        self.pair_ids.update(used)
        return len(records)

    def feature_key(self, create: bool = True) -> bytes:
        """The 32-byte secret this store's prompt features are keyed by, from its key file
        (``autospec.store.keys``: beside a SQLite file, else in the cache directory, or
        $AUTOSPEC_FEATURE_KEY_FILE), created there on first use when ``create`` and the store
        is writable. FeatureKeyError (a StoreError) where it cannot be read or created."""
        from .keys import key_file, load_key, random_key

        with self._key_lock:
            if self._key is None:
                path = key_file(self._u)
                self._key = (random_key() if path is None
                             else load_key(path, create=create and not self.read_only))
            return self._key

    def writer(self, **kwargs: Any):
        """A started background writer on this store (see ``StoreWriter``); StoreReadOnly for
        a store opened read-only."""
        from .writer import StoreWriter

        if self.read_only:
            raise StoreReadOnly(f"the store at {self.url} was opened read-only: it takes no "
                                "records (open it without read_only to write)")
        return StoreWriter(self, **kwargs)

    def close(self, timeout: float = 10.0) -> None:
        """Flush and stop this store's writers, then close its connections. Idempotent."""
        while self._writers:
            self._writers.pop().close(timeout=timeout)
        if not self.closed:
            self.closed = True
            self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(url: str | os.PathLike | None = None, *, busy_timeout_s: float = 30.0,
               read_only: bool = False) -> Store:
    """Open (creating or upgrading the schema as needed) the store at ``url``.

    ``read_only``: for readers (``autospec stats``, ``report``): nothing is created, migrated
    or written — a SQLite file must exist and is opened ``mode=ro`` (``immutable=1`` where
    its directory is not writable and its log cannot be used: ``autospec/store/readonly.py``; the
    store's ``stale`` says what such a view misses), a PostgreSQL session is read-only; a
    store whose schema is behind this autospec's is refused with what to do.

    ``None``: ``sqlite:///<cache>/autospec.db`` (cache = $AUTOSPEC_CACHE, else
    $XDG_CACHE_HOME/autospec, else ~/.cache/autospec). A string without ``://`` is a SQLite
    file path. ``busy_timeout_s`` bounds how long a SQLite write waits for the file's lock
    (and a PostgreSQL connection attempt). Raises StoreError for a malformed URL, an unknown
    dialect or missing driver, an unreachable server or unusable file; StoreUnusable for a
    store that is there but cannot be written as it is: StoreTooNew (written by a newer
    autospec), StoreReadOnly (a writing open of a store this process may not write),
    StoreDamaged (a damaged SQLite file).
    """
    from .migrate import check_readable, upgrade
    from .readonly import read_only_message, read_only_sqlite, refuses_writes

    u = _resolve(url)
    opened, stale = u, None
    if read_only and u.get_backend_name() == "sqlite":
        opened, stale = read_only_sqlite(u)
    engine = _make_engine(opened, busy_timeout_s, read_only)
    safe = u.render_as_string(hide_password=True)
    try:
        if read_only:
            check_readable(engine)
        else:
            upgrade(engine)
    except StoreError as exc:
        engine.dispose()
        exc.url = safe
        raise
    except (SQLAlchemyError, sqlite3.Error) as exc:
        engine.dispose()
        damaged = damage_of(exc, engine.url)
        if damaged is not None:
            damaged.url = safe
            raise damaged from exc
        orig = getattr(exc, "orig", None) or exc
        detail = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        if not read_only and refuses_writes(exc):  # e.g. no -wal can be created beside it
            error: StoreError = StoreReadOnly(read_only_message(detail))
        elif engine.dialect.name == "sqlite":
            error = StoreError(f"cannot open the store at {safe}: {detail}; " + (
                "check that it is readable by this user" if read_only else
                "check that the path is a writable SQLite database file (not another kind of "
                "file)"))
        else:
            error = StoreError(f"cannot open the store at {safe}: {detail}; check that the "
                               "server is running and reachable, and the URL's host, port, "
                               "user, password and database name")
        error.url = safe
        raise error from exc
    except OSError as exc:
        engine.dispose()
        raise StoreError(f"cannot open the store at {safe}: {exc}") from exc
    if stale is not None:
        log.warning("autospec: %s", stale)
    log.debug("opened store %s", safe)
    return Store(engine, u, read_only=read_only, stale=stale)
