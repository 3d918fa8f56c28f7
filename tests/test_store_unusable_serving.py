"""Serving with a store it cannot write: written by a newer autospec (a fleet rolled back),
read-only for this process, damaged. ``wrap`` succeeds and generation is what it would be
without a store; one warning says why and what to do, and the failure is counted. A store URL
that reaches no database at all still fails at wrap time. Real SQLite files, PostgreSQL
where AUTOSPEC_TEST_POSTGRES_URL is set (as tests/test_store.py)."""

from __future__ import annotations

import logging
import random
import sqlite3
from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import autospec
from autospec.store import StoreError, open_store
from autospec.store.tables import VERSION_TABLE

from conftest import noisy_copy, prompt, tiny
from test_store import fresh_url, make_record


@pytest.fixture(scope="module")
def models():
    target = tiny("qwen2", sharpen=30.0)
    return target, noisy_copy(target, 0.15)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    with open_store(u) as st:
        st.write([make_record(random.Random(i), category="code") for i in range(3)])
    yield u
    cleanup()


def _requests(url: str) -> int:
    engine = create_engine(url)
    with engine.connect() as conn:
        n = conn.scalar(text("SELECT count(*) FROM requests"))
    engine.dispose()
    return n


def _serve(models, store, caplog, **options):
    """wrap with ``store``, serve three requests; (controller, outputs, plain outputs,
    the warnings logged while wrapping and serving)."""
    target, draft = models
    plain = autospec.Controller(target, draft, store=False)
    with caplog.at_level(logging.WARNING):
        spec = autospec.wrap(target, draft, store=store, **options)
        try:
            outs = [target.generate(prompt(9, seed=s), max_new_tokens=12, do_sample=False, k=3,
                                    category="code") for s in range(3)]
        finally:
            spec.close()
            autospec.unwrap(target)
    want = [plain.generate(prompt(9, seed=s), max_new_tokens=12, do_sample=False, k=3)
            for s in range(3)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return spec, outs, want, warnings


def test_a_store_written_by_a_newer_autospec_serves_without_telemetry(models, url, caplog):
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'"))
    engine.dispose()
    path = Path(make_url(url).database) if url.startswith("sqlite") else None
    before = path.read_bytes() if path else None
    spec, outs, want, warnings = _serve(models, url, caplog)
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert len(warnings) == 1, warnings
    assert "serving without telemetry" in warnings[0] and "newer autospec" in warnings[0]
    assert "upgrade autospec" in warnings[0]  # what to do
    assert spec.store is None and spec.writer is None
    assert spec.store_failures == 1 and "newer autospec" in spec.store_unusable
    assert _requests(url) == 3  # nothing written, nothing migrated
    if path:
        assert path.read_bytes() == before


def _read_only_url(url: str) -> str:
    """The same store through a URL whose connections cannot write it."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return f"sqlite:///file:{u.database}?mode=ro&uri=true"
    ro = u.update_query_dict({"options": f"{u.query['options']} -c "
                              "default_transaction_read_only=on"})
    return ro.render_as_string(hide_password=False)


def test_a_read_only_store_serves_reading_it_and_writing_nothing(models, url, caplog,
                                                                 tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing lands here (the bandwidth figure goes to the cache)
    spec, outs, want, warnings = _serve(models, _read_only_url(url), caplog)
    assert list(cwd.iterdir()) == []
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert len(warnings) == 1, warnings
    assert "serving without telemetry" in warnings[0]
    assert "cannot be written by this process" in warnings[0]
    assert "still read" in warnings[0]
    assert spec.writer is None and spec.store_failures == 1
    assert spec.store is not None and spec.store.read_only
    assert _requests(url) == 3


def test_a_read_only_store_still_warms_the_policy(url):
    """What the store knows reaches a server that cannot write it: the category's history."""
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, target, store=url)  # the draft is the target: α = 1
    for _ in range(3):
        spec.generate(prompt(), max_new_tokens=24, do_sample=False, k=3, eos_token_id=None)
    spec.close()
    warmed = {}
    for name, store in (("read-only", _read_only_url(url)), ("none", False)):
        spec = autospec.Controller(target, target, store=store, policy="auto")
        warmed[name] = spec.live_stats("default").acceptance("draft", 0)[0]
        spec.close()
    assert warmed["read-only"] > 0.9 > warmed["none"]


def test_a_damaged_store_serves_without_telemetry(models, tmp_path, caplog):
    path = tmp_path / "autospec.db"
    path.write_bytes(b"SQLite format 3\x00" + b"\xa5" * 8192)
    spec, outs, want, warnings = _serve(models, str(path), caplog)
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert len(warnings) == 1 and "serving without telemetry" in warnings[0], warnings
    assert "restore it from a backup" in warnings[0]
    assert spec.store is None and spec.store_failures == 1


def test_a_named_categoriser_in_an_unusable_store_is_not_loaded_and_serving_goes_on(
        models, url, caplog):
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'"))
    engine.dispose()
    spec, outs, want, warnings = _serve(models, url, caplog, categorize="prod")
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert any("categoriser 'prod'" in w for w in warnings), warnings
    assert spec.categorizer is None


@pytest.mark.parametrize("bad", ["postgresql+nosuchdriver://x@localhost/db", "notadialect://x",
                                 "://", "a directory", "under a file"])
def test_a_store_url_that_reaches_no_database_fails_at_wrap_time(models, tmp_path, bad):
    target, draft = models
    if bad == "a directory":
        bad = str(tmp_path)
    elif bad == "under a file":
        (tmp_path / "file").write_text("not a directory")
        bad = str(tmp_path / "file" / "autospec.db")
    with pytest.raises(StoreError) as e:
        autospec.wrap(target, draft, store=bad)
    assert not isinstance(e.value, autospec.store.StoreUnusable)
    assert "generate" not in vars(target)  # nothing was wrapped


def test_serving_without_a_store_counts_no_failures(models):
    spec = autospec.Controller(*models, store=False)
    assert spec.store_failures == 0 and spec.store_unusable is None
    spec.close()


def test_sqlite_file_of_an_unusable_store_is_left_as_it_was(models, tmp_path):
    """A newer autospec's store may use another journal mode: serving must not switch it."""
    path = tmp_path / "future.db"
    open_store(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'")
    assert conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    conn.close()
    before = path.read_bytes()
    autospec.Controller(*models, store=str(path)).close()
    assert path.read_bytes() == before
