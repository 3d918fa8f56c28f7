"""Read-only stores: opening a SQLite file for readers (``mode=ro``, and ``immutable=1`` where
SQLite cannot keep the write-ahead log's index beside the file), and telling a writer that
the store is read-only for it (``refuses_writes``, ``read_only_message``).

A WAL-mode file is read through its ``-wal`` log and ``-shm`` index. A reader that may not
write the directory (read-only media, a snapshot, another user's directory) can still use
them where both are there and readable (a copy taken while a server wrote, or a live
server's own); where they are not, SQLite cannot create them, and the file is opened
``immutable=1``: the main file alone, no locks, nothing created. Such a reader does not see
the commits still in a ``-wal`` it cannot apply: that is said (``stale``), not hidden.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

from sqlalchemy.engine import URL

from .database import DB_FILENAME, StoreError, _sqlite_memory

__all__ = ["read_only_sqlite", "refuses_writes", "read_only_message"]


def read_only_sqlite(u: URL) -> tuple[URL, str | None]:
    """(the URL that opens the same SQLite file read-only, None or what that view misses).

    The file must exist; nothing is created. A caller's own ``file:`` URI keeps its mode."""
    if _sqlite_memory(u):
        raise StoreError("an in-memory store holds nothing to read; give the file a server "
                         "writes to")
    db = u.database or ""
    if u.query.get("uri") == "true" or db.startswith("file:"):
        return u, None  # the caller's own URI: its mode stands
    path = Path(db).expanduser().absolute()
    if path.is_dir():
        raise StoreError(f"store path {str(path)!r} is a directory; give a file path inside it, "
                         f"e.g. {str(path / DB_FILENAME)!r}")
    if not path.is_file():
        raise StoreError(f"no store at {str(path)!r}: nothing has been logged there (check "
                         "--db; a serving process creates the store on its first request)")
    immutable = _log_unusable(path)
    query = "?mode=ro&immutable=1" if immutable else "?mode=ro"
    opened = u.set(database=f"file:{quote(str(path))}{query}", query={"uri": "true"})
    return opened, _missed(path) if immutable else None


def _log_unusable(path: Path) -> bool:
    """A WAL-mode file whose log SQLite cannot use here: the directory is not writable (so
    neither -wal nor -shm can be created) and they are not both there and readable."""
    if os.access(path.parent, os.W_OK) or not _wal_mode(path):
        return False
    return not all(os.access(f"{path}{suffix}", os.R_OK) for suffix in ("-wal", "-shm"))


def _wal_mode(path: Path) -> bool:
    """The file's header says WAL (its read and write format versions are 2)."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return False  # unreadable: SQLite says so when it opens it
    return len(header) == 20 and header[18] == 2


def _missed(path: Path) -> str | None:
    """The one line a reader of an immutable view needs when a -wal with commits is beside
    the file: which commits are not shown, and how to read them."""
    wal = Path(f"{path}-wal")
    try:
        size = wal.stat().st_size
    except OSError:
        return None
    if size == 0:
        return None
    return (f"the commits in {wal} ({size} bytes not yet checkpointed into the store) are not "
            f"shown: SQLite cannot apply that log here (the directory is read-only and "
            f"{path.name}-shm is missing or unreadable); to read them, copy {path.name} and "
            f"{wal.name} into a writable directory and read the copy")


def refuses_writes(exc: BaseException) -> bool:
    """Whether a SQLite error says the database is read-only here (SQLITE_READONLY and its
    extended codes: a read-only file, directory, media or ``mode=ro`` connection)."""
    orig = getattr(exc, "orig", None) or exc
    if not isinstance(orig, sqlite3.Error):
        return False
    code = getattr(orig, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF == sqlite3.SQLITE_READONLY
    return "readonly database" in str(orig)


def read_only_message(detail: str) -> str:
    """StoreReadOnly's message for a writing open (``detail``: what the database said)."""
    return (f"this store cannot be written by this process ({detail}): write it as a user "
            "that may, or give a writable copy; the reading commands (stats, report, "
            "explain, export) read it as it is")
