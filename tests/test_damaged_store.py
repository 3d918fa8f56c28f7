"""A store whose SQLite file is damaged on disk (its header intact, pages overwritten) is one
error line saying so and what to do, status 2, in every command that reads it — whether the
damage shows when the store opens or only in a query — and ``StoreDamaged`` in the library."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from autospec.cli import main
from autospec.store import StoreDamaged, StoreError, open_store, queries
from autospec.store.tables import VERSION_TABLE

from test_store import make_record


def _store_with_traffic(path: Path) -> None:
    rng = random.Random(7)
    with open_store(path) as store:
        store.write([make_record(rng, category="code") for _ in range(300)])
    con = sqlite3.connect(path)  # everything in the main file, nothing left in the WAL
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


def _overwrite(path: Path, pages: list[int]) -> None:
    """Overwrite whole pages (1-based) with bytes no b-tree page starts with."""
    con = sqlite3.connect(path)
    size = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    data = bytearray(path.read_bytes())
    for page in pages:
        assert page > 1  # page 1 holds the header and the schema: they stay intact
        data[(page - 1) * size: page * size] = b"\xa5" * size
    path.write_bytes(bytes(data))


def _root_pages(path: Path, *, but: str) -> list[int]:
    con = sqlite3.connect(path)
    rows = con.execute("SELECT tbl_name, rootpage FROM sqlite_master WHERE rootpage > 1")
    pages = sorted({page for table, page in rows if table != but})
    con.close()
    return pages


@pytest.fixture(params=["in a query", "at open"])
def damaged(request, tmp_path) -> Path:
    path = tmp_path / "autospec.db"
    _store_with_traffic(path)
    if request.param == "in a query":  # the schema version reads fine; every table does not
        _overwrite(path, _root_pages(path, but=VERSION_TABLE))
    else:  # every page after the first
        con = sqlite3.connect(path)
        count = con.execute("PRAGMA page_count").fetchone()[0]
        con.close()
        _overwrite(path, list(range(2, count + 1)))
    assert path.read_bytes()[:16] == b"SQLite format 3\x00"  # the header is intact
    return path


@pytest.mark.parametrize("command", [["stats"], ["report"],
                                     ["export", "--engine", "vllm", "--category", "code"]])
def test_reading_commands_say_the_store_is_damaged_and_what_to_do(damaged, command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--db", str(damaged)])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("autospec: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "sqlalchemy" not in err.lower()
    assert f"the store {damaged} is damaged" in err
    assert "restore it from a backup" in err and ".recover" in err


def test_the_library_raises_store_damaged_naming_the_file(damaged):
    with pytest.raises(StoreDamaged, match="is damaged") as e:
        with open_store(damaged, read_only=True) as store, store.session() as s:
            queries.category_summaries(s)
    assert isinstance(e.value, StoreError) and str(damaged) in str(e.value)


def test_an_intact_store_reads_as_before(tmp_path, capsys):
    path = tmp_path / "autospec.db"
    _store_with_traffic(path)
    assert main(["stats", "--db", str(path)]) == 0
    assert "code" in capsys.readouterr().out
