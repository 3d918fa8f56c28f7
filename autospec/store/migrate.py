"""Schema versioning: bring a database to this version's Alembic head, or refuse it.

``upgrade(engine)`` first reads the database's revision (from ``autospec_alembic_version``,
not Optuna's ``alembic_version``) in a read transaction. A revision this version does not
know means a newer autospec wrote the file: StoreTooNew, and nothing is written (not even the
switch to WAL). A database this process may not write is StoreReadOnly, found before any
write (a write rolled back: ``check_writable``). Otherwise a SQLite file is put in WAL mode
and, if the schema is behind, the migrations run in one write transaction (SQLite:
``BEGIN IMMEDIATE``; PostgreSQL: under an advisory lock), so processes opening a new store
together create it once.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from .database import (
    _PG_LOCK_ID,
    StoreError,
    StoreReadOnly,
    StoreTooNew,
    _sqlite_memory,
    ensure_wal,
)
from .readonly import read_only_message, refuses_writes
from .tables import VERSION_TABLE

__all__ = ["upgrade", "check_readable", "check_writable", "current_revision", "head_revision"]

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


@lru_cache(maxsize=1)
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head_revision() -> str:
    return _script().get_current_head()


def current_revision(conn: Connection) -> tuple[str, ...]:
    """The database's schema revision(s); empty for a database without our tables."""
    ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return tuple(ctx.get_current_heads())


def _check(current: tuple[str, ...]) -> bool:
    """True if an upgrade is needed; StoreTooNew if the database is newer than this code."""
    known = {s.revision for s in _script().walk_revisions()}
    unknown = [r for r in current if r not in known]
    if unknown:
        raise StoreTooNew(
            f"this database was written by a newer autospec (schema revision {unknown[0]}; "
            f"this version knows up to {head_revision()}); upgrade autospec to use it. "
            "The database was left unchanged.")
    return set(current) != set(_script().get_heads())


def upgrade(engine: Engine) -> None:
    with engine.connect() as conn, conn.begin():
        needed = _check(current_revision(conn))  # raises, having written nothing, if newer
    check_writable(engine)
    ensure_wal(engine)
    if not needed:
        return
    with engine.execution_options(autospec_write=True).connect() as conn:
        # SQLite rebuilds a table to alter it (Alembic's batch mode): with foreign keys
        # enforced, dropping the old copy would cascade into the rows that reference it. As
        # SQLite's own procedure for schema changes has it, enforcement is off while the
        # migrations run (set outside the transaction: inside, the pragma does nothing), the
        # keys are checked before committing, and enforcement is back on after.
        raw = conn.connection.dbapi_connection if engine.dialect.name == "sqlite" else None
        if raw is not None:
            raw.execute("PRAGMA foreign_keys=OFF")
        try:
            with conn.begin():
                if engine.dialect.name == "postgresql":
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_ID})")
                current = current_revision(conn)  # again, under the lock: another may be first
                if not _check(current):
                    return
                log.info("upgrading store schema %s → %s", ",".join(current) or "(empty)",
                         head_revision())
                cfg = _config()
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
                if raw is not None:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
                    if broken:
                        raise StoreError(f"the schema upgrade would leave {len(broken)} row(s) "
                                         f"pointing at nothing (first: {tuple(broken[0])}); "
                                         "nothing was changed")
        finally:
            if raw is not None:
                raw.execute("PRAGMA foreign_keys=ON")


def check_writable(engine: Engine) -> None:
    """StoreReadOnly if this process may not write the database; nothing is written either
    way. SQLite: a write (the header's user_version, set to itself) in a transaction rolled
    back — a read-only file takes the write lock and refuses only the write. PostgreSQL:
    whether sessions are read-only (a standby, ``default_transaction_read_only``)."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            if conn.exec_driver_sql("SHOW transaction_read_only").scalar() == "on":
                raise StoreReadOnly(read_only_message("its sessions are read-only"))
        return
    if engine.dialect.name != "sqlite" or _sqlite_memory(engine.url):
        return
    with engine.execution_options(autospec_write=True).connect() as conn:
        trans = conn.begin()  # BEGIN IMMEDIATE
        try:
            version = int(conn.exec_driver_sql("PRAGMA user_version").scalar())
            conn.exec_driver_sql(f"PRAGMA user_version = {version}")
        except Exception as exc:
            if not refuses_writes(exc):
                raise
            detail = str(getattr(exc, "orig", exc)).strip()
            raise StoreReadOnly(read_only_message(detail)) from exc
        finally:
            trans.rollback()


def check_readable(engine: Engine) -> None:
    """For a read-only open: the database holds this version's schema, else StoreError
    (nothing is written either way)."""
    with engine.connect() as conn, conn.begin():
        current = current_revision(conn)
        needed = _check(current)  # raises if newer
    if not current:
        raise StoreError("this database holds no autospec store (no schema revision): check "
                         "the URL; a serving process creates the store on its first request")
    if needed:
        raise StoreError(
            f"this store's schema (revision {','.join(current)}) is older than this autospec "
            f"reads ({head_revision()}); read commands never change a store: open it once with "
            "a writing one (serving, `autospec probe` or `autospec tune`) to upgrade it in "
            "place, nothing logged is lost")
