"""A store's feature key: the secret that keys its prompt features, kept outside its tables;
and clearing the features a store should no longer hold (``forget_features``).

Prompt features (``autospec.categorize.features``) are hashed under a 32-byte secret, so that
the store alone — a copy of the file, a backup, a read-only user, a SQL dump — holds nothing
that can be turned back into text. The secret lives in a key file (64 hex digits), found as:

- ``$AUTOSPEC_FEATURE_KEY_FILE`` when set: that file, for every store the process opens (a
  fleet of servers writing one store shares one key this way);
- a SQLite store: beside its file, ``<file>.feature-key``;
- any other URL (PostgreSQL): ``<cache dir>/feature-keys/<backend>-<hash>.key``, named from
  the store's server, port, database and options (never the user or the password);
- an in-memory SQLite store: a random key that lives as long as the ``Store``.

A writable store creates its key file on first use (mode 0600; two processes creating it at
once agree on one key); a read-only store never creates one. Deleting the file rotates the
key: the next writer makes a new one, and features under the old key stop being usable.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import stat
from pathlib import Path

from sqlalchemy.engine import URL

from .database import StoreError, _sqlite_file, _sqlite_memory, cache_dir

__all__ = ["KEY_ENV", "KEY_BYTES", "FeatureKeyError", "key_file", "load_key", "random_key",
           "standalone_key", "forget_features"]

log = logging.getLogger(__name__)

KEY_ENV = "AUTOSPEC_FEATURE_KEY_FILE"
KEY_BYTES = 32
_warned_modes: set[str] = set()
# the URL query parameters that say which database a store is (libpq's names), not who connects
_IDENTITY = ("host", "hostaddr", "port", "dbname", "service", "options")


class FeatureKeyError(StoreError):
    """The feature key cannot be read or created; the message says where and what to do."""


def key_file(u: URL) -> Path | None:
    """Where the store at ``u`` keeps its feature key (None: in memory, no file)."""
    env = os.environ.get(KEY_ENV, "").strip()
    if env:
        return Path(env).expanduser().absolute()
    backend = u.get_backend_name()
    if backend == "sqlite":
        if _sqlite_memory(u):
            return None
        path = Path(_sqlite_file(u)).expanduser().absolute()
        return path.with_name(path.name + ".feature-key")
    where = "&".join(f"{k}={v}" for k, v in sorted(u.query.items()) if k in _IDENTITY)
    identity = f"{backend}://{u.host or ''}:{u.port or ''}/{u.database or ''}?{where}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir() / "feature-keys" / f"{backend}-{digest}.key"


def random_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _parse(text: str, path: Path) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        secret = b""
    if len(secret) != KEY_BYTES:
        raise FeatureKeyError(
            f"{path} is not a feature key ({2 * KEY_BYTES} hex digits expected): restore it "
            "from where it was copied, or move it away to start a new key (features logged "
            "under the old one then stop being usable)")
    return secret


def _check_mode(path: Path) -> None:
    with contextlib.suppress(OSError):
        mode = path.stat().st_mode
        if os.name == "posix" and mode & 0o077 and str(path) not in _warned_modes:
            _warned_modes.add(str(path))
            log.warning("the feature key %s is readable by other users (mode %s): "
                        "`chmod 600` it; with it and the store, prompts can be read back",
                        path, oct(stat.S_IMODE(mode)))


def _create(path: Path) -> bytes:
    """A new key in ``path``, unless another process creates it first (then its key)."""
    secret = random_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic: the file appears whole, or not at all
        except FileExistsError:
            return _parse(path.read_text(), path)  # another process made it first
        except OSError:  # no hard links on this filesystem: create it in place
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return _parse(path.read_text(), path)
            with os.fdopen(fd, "w") as f:
                f.write(secret.hex() + "\n")
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    log.info("created the feature key %s (keep it with the store, private: with both, "
             "prompts can be read back; docs/store.md)", path)
    return secret


def load_key(path: Path, *, create: bool) -> bytes:
    """The key in ``path``; created there when missing and ``create``. FeatureKeyError when
    it cannot be read or created (the message says where and why)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if not create:
            raise FeatureKeyError(
                f"no feature key at {path}: prompt features can be used only under the key "
                f"they were logged with; copy that key file there, or point ${KEY_ENV} at "
                "it (docs/store.md)") from None
        try:
            return _create(path)
        except OSError as exc:
            raise FeatureKeyError(f"cannot create the feature key {path}: "
                                  f"{exc.strerror or exc}; make its directory writable or "
                                  f"set ${KEY_ENV} to a writable path") from None
    except (OSError, UnicodeDecodeError) as exc:
        detail = getattr(exc, "strerror", None) or exc
        raise FeatureKeyError(f"cannot read the feature key {path}: {detail}; check that it "
                              "is a file readable by this user") from None
    _check_mode(path)
    return _parse(text, path)


def standalone_key() -> bytes:
    """The key of a process without a store: ``$AUTOSPEC_FEATURE_KEY_FILE``'s when set (not
    created), else a random one (its features never leave the process)."""
    env = os.environ.get(KEY_ENV, "").strip()
    if env:
        return load_key(Path(env).expanduser().absolute(), create=False)
    return random_key()


def forget_features(store, *, every: bool = False) -> int:
    """Clear stored prompt features: those in the unkeyed format 1 (which can be read back
    into tokens), or with ``every`` all of them (after a key leaked). Returns how many
    requests lost theirs; nothing else of a request changes. SQLite overwrites the cleared
    bytes (``secure_delete``) and then truncates its WAL (where a reader still holds it, the
    old pages go at a later checkpoint: logged); PostgreSQL keeps the old row versions until
    they are vacuumed (``VACUUM FULL requests`` rewrites the table without them)."""
    from sqlalchemy import LargeBinary, func, literal, text, update

    from .tables import Request

    stmt = update(Request).where(Request.features.is_not(None)).values(features=None)
    if not every:
        stmt = stmt.where(func.substr(Request.features, 1, 1) == literal(b"\x01", LargeBinary))
    with store.begin() as s:
        if store.dialect == "sqlite":
            s.execute(text("PRAGMA secure_delete=ON"))
        cleared = s.execute(stmt).rowcount
    if store.dialect == "sqlite" and cleared:
        raw = store.engine.raw_connection()
        try:
            busy = raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        finally:
            raw.close()
        if busy:
            log.warning("another process is reading %s: the cleared features leave its WAL at "
                        "the next checkpoint", store.url)
    return cleared
