"""Opening a store: bad URLs, files and directories, the default location, sharing the
database with Optuna, in-memory stores, and no torch import."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from sqlalchemy import text

from autospec.store import StoreError, default_url, open_store
from autospec.store.migrate import current_revision, head_revision
from autospec.store.tables import VERSION_TABLE

from test_store import assert_stats_match, make_record


@pytest.mark.parametrize("bad, message", [
    ("", "empty store URL"),
    ("://nothing", "malformed store URL"),
    ("postgresql+psycopg://u:secret@h:port/db", "malformed store URL"),
    ("postgresql+nosuch://u@localhost/db", r"unknown database kind 'postgresql\+nosuch'"),
    ("nosuchdb://u@localhost/db", "unknown database kind"),
    ("mysql://u@localhost/db", "driver for 'mysql' is not installed"),
])
def test_bad_urls_raise_store_error_saying_what_to_do(bad, message):
    with pytest.raises(StoreError, match=message) as err:
        open_store(bad)
    assert "secret" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_unreachable_server_is_a_store_error():
    pytest.importorskip("psycopg")
    with pytest.raises(StoreError, match="cannot open the store at .*check that the server"):
        open_store("postgresql+psycopg://nobody:pw@127.0.0.1:1/none", busy_timeout_s=2)


def test_migration_from_an_empty_file(tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with open_store(str(path)) as st:
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),)
            names = set(conn.execute(text(
                "SELECT name FROM sqlite_master WHERE type='table'")).scalars())
            assert {"pairs", "requests", "category_stats", "probes", VERSION_TABLE} <= names
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_sqlite_paths_create_their_directory_or_say_why_not(tmp_path):
    with open_store(tmp_path / "a" / "b" / "store.db") as st:
        assert st.url.endswith("/a/b/store.db")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create the directory"):
        open_store(str(tmp_path / "file" / "store.db"))
    with pytest.raises(StoreError, match="is a directory"):
        open_store(str(tmp_path))
    (tmp_path / "junk.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="not a database"):
        open_store(f"sqlite:///{tmp_path / 'junk.db'}")


def test_default_url_follows_the_cache_rules(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOSPEC_CACHE", str(tmp_path / "c"))
    assert default_url() == f"sqlite:///{tmp_path / 'c' / 'autospec.db'}"
    monkeypatch.delenv("AUTOSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_url() == f"sqlite:///{tmp_path / 'x' / 'autospec' / 'autospec.db'}"
    with open_store(None) as st:
        assert st.url == default_url()
    assert (tmp_path / "x" / "autospec" / "autospec.db").exists()


def test_optuna_can_share_the_database(tmp_path):
    optuna = pytest.importorskip("optuna")
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name="k")
    study.optimize(lambda t: t.suggest_int("k", 1, 8), n_trials=2)
    with open_store(url) as st:  # our own version table: Optuna's alembic_version untouched
        st.write([make_record(random.Random(8))])
    assert len(optuna.load_study(storage=url, study_name="k").trials) == 2


def test_in_memory_store_works_with_the_writer():
    with open_store("sqlite://") as st:
        w = st.writer()
        rng = random.Random(9)
        recs = [make_record(rng) for _ in range(50)]
        assert all(w.submit(r) for r in recs) and w.flush(10)
        with st.session() as s:
            assert_stats_match(s, recs)


def test_importing_the_store_does_not_import_torch():
    code = "import autospec.store, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- read-only opens (autospec stats, report, categorize show) ---------------------------------

def test_read_only_open_creates_nothing_at_a_mistyped_path(tmp_path):
    missing = tmp_path / "typo" / "sub" / "autospec.db"
    with pytest.raises(StoreError, match="no store at .*typo/sub/autospec.db.*check --db"):
        open_store(missing, read_only=True)
    assert not (tmp_path / "typo").exists()  # neither the file nor its folders
    with pytest.raises(StoreError, match="is a directory"):
        open_store(tmp_path, read_only=True)


def test_read_only_open_reads_and_never_writes(tmp_path):
    path = tmp_path / "s.db"
    records = [make_record(random.Random(i), category="code") for i in range(3)]
    with open_store(path) as st:
        st.write(records)
    before = path.read_bytes()
    with open_store(path, read_only=True) as st, st.session() as s:
        assert_stats_match(s, records)
        assert str(path) in st.url and "mode=ro" not in st.url  # the user's URL, as given
        with pytest.raises(Exception, match="readonly"):  # SQLite itself refuses writes
            s.execute(text("DELETE FROM requests"))
    assert path.read_bytes() == before


def test_read_only_open_refuses_an_older_schema_without_migrating_it(tmp_path):
    from alembic import command
    from sqlalchemy import create_engine

    from autospec.store.migrate import _config

    path = tmp_path / "old.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        cfg = _config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0003")
    engine.dispose()
    with pytest.raises(StoreError, match="older than this autospec reads.*upgrade it in place"):
        open_store(path, read_only=True)
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        assert current_revision(conn) == ("0003",)  # left as it was
    engine.dispose()
    with open_store(path) as st, st.engine.connect() as conn:  # a writing open upgrades it
        assert current_revision(conn) == (head_revision(),)


def test_read_only_open_of_a_file_that_is_not_a_store(tmp_path):
    from sqlalchemy import create_engine

    path = tmp_path / "other.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (x INTEGER)"))
    engine.dispose()
    with pytest.raises(StoreError, match="holds no autospec store"):
        open_store(path, read_only=True)


def test_read_only_open_of_postgresql_reads_and_refuses_writes(tmp_path):
    from test_store import fresh_url

    url, cleanup = fresh_url("postgresql", tmp_path)
    try:
        records = [make_record(random.Random(i), category="chat") for i in range(3)]
        with open_store(url) as st:
            st.write(records)
        with open_store(url, read_only=True) as st, st.session() as s:
            assert_stats_match(s, records)  # the schema the URL selects, read
            with pytest.raises(Exception, match="read-only transaction"):
                s.execute(text("DELETE FROM requests"))
    finally:
        cleanup()
