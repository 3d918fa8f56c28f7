"""Prompts cannot be read back from the store (issue 47, item 5).

The attack an outside check ran on the unkeyed features: hash every token id of the vocabulary
(V = 151 936, Qwen2.5's) with the public n-gram hash, keep the ids whose unigram bucket the
row holds, link two of them where their bigram's bucket is there too, and walk the links —
which rebuilt a 40-token prompt exactly. Here it runs against a row that a wrapped tiny model
(its vocabulary 32 000 ids) wrote to a real SQLite store with every default, read from the
database file alone: with the public hash, and with the keyed hash under guessed keys. It
must learn nothing of the prompt. The same attack on the old unkeyed encoding of the same
prompt (an independent copy of it, pinned to the hash old releases pinned) rebuilds it, and so
does the attack on the stored row by someone holding the store's key file: the key is the
secret, and the attack is a real one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import sqlite3
import stat
import threading

import numpy as np
import pytest
import torch

import autospec
from autospec.categorize.features import FeatureKey, prompt_features
from autospec.cli import main
from autospec.store import FeatureKeyError, open_store, queries
from autospec.store.keys import KEY_ENV, key_file, load_key

from conftest import tiny
from test_store import BACKENDS, fresh_url
from test_store import make_record as store_record

V_ATTACK = 151_936  # the vocabulary the attacker hashes
V_MODEL = 32_000  # the tiny model's
PROMPT_LEN = 40

# -- the public n-gram hash (format 1), copied from autospec before features were keyed --------

_MASK = np.uint64((1 << 18) - 1)
_K1, _K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def unigram_buckets(labels: np.ndarray) -> np.ndarray:
    return _mix(labels * _K1 + np.uint64(1)) & _MASK


def bigram_buckets(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _mix(a * _K1 + b * _K2 + np.uint64(2)) & _MASK


def unkeyed_features(ids) -> bytes:
    """What autospec stored before features were keyed (format 1): the public hash of the
    token ids themselves (head 256 / tail 768 cut left out: the prompts here are short)."""
    ids = np.asarray(list(ids), dtype=np.int64).view(np.uint64)
    buckets = np.concatenate([unigram_buckets(ids), bigram_buckets(ids[:-1], ids[1:])])
    idx, counts = np.unique(buckets, return_counts=True)
    return bytes([1]) + idx.astype("<u4").tobytes() + counts.astype("<u2").tobytes()


OLD_GOLDEN = "6076b0f093105499"  # old releases' pinned sha256 of their features of range(100)


# -- the attack ---------------------------------------------------------------------------------

def parse(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """A row's buckets and counts, read as an outsider reads the bytes (format 1 or 2)."""
    header = 1 if blob[0] == 1 else 5
    n = (len(blob) - header) // 6
    return (np.frombuffer(blob, "<u4", n, header).astype(np.uint64),
            np.frombuffer(blob, "<u2", n, header + 4 * n).astype(np.int64))


def reconstruct(blob: bytes, labels: np.ndarray, max_steps: int = 200_000):
    """(the longest walk the row allows, the ids whose unigram bucket is in the row, the
    linked pairs): ``labels[t]`` is what the attacker believes token t hashes as."""
    idx, counts = parse(blob)
    budget = dict(zip(idx.tolist(), counts.tolist()))
    length = (int(counts.sum()) + 1) // 2  # unigrams + bigrams = 2L - 1: the length leaks
    uni = unigram_buckets(labels.copy())
    present = np.flatnonzero(np.isin(uni, idx))
    a, b = (m.ravel() for m in np.meshgrid(present, present, indexing="ij"))
    bi = bigram_buckets(labels[a], labels[b])
    hit = np.isin(bi, idx)
    links: dict[int, list[tuple[int, int]]] = {}
    for s, t, bucket in zip(a[hit].tolist(), b[hit].tolist(), bi[hit].tolist()):
        links.setdefault(s, []).append((t, bucket))
    has_in = {t for edges in links.values() for t, _ in edges}
    best: list[int] = []
    steps = 0

    def walk(path: list[int]) -> bool:
        nonlocal best, steps
        steps += 1
        if len(path) > len(best):
            best = list(path)
        if len(path) == length or steps > max_steps:
            return len(path) == length
        for t, bucket in links.get(path[-1], ()):
            ub = int(uni[t])
            if budget.get(bucket, 0) < 1 or budget.get(ub, 0) < 1 + (ub == bucket):
                continue
            budget[bucket] -= 1
            budget[ub] -= 1
            path.append(t)
            done = walk(path)
            path.pop()
            budget[bucket] += 1
            budget[ub] += 1
            if done:
                return True
        return False

    for start in sorted(present.tolist(), key=lambda t: (t in has_in, t)):
        ub = int(uni[start])
        budget[ub] -= 1
        done = walk([start])
        budget[ub] += 1
        if done or steps > max_steps:
            break
    return best, set(present.tolist()), {(s, t) for s, edges in links.items() for t, _ in edges}


def longest_shared_run(a: list[int], b: list[int]) -> int:
    """The longest run of consecutive tokens that ``a`` and ``b`` share."""
    best, prev = 0, [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b):
            if x == y:
                cur[j + 1] = prev[j] + 1
                best = max(best, cur[j + 1])
        prev = cur
    return best


VOCAB_IDS = np.arange(V_ATTACK, dtype=np.int64)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(prompt, the features row, the store's path): one request served by a wrapped tiny
    model with every default (policy, features on, store a SQLite file)."""
    path = tmp_path_factory.mktemp("privacy") / "autospec.db"
    model = tiny(vocab=V_MODEL)
    ids = torch.tensor([np.random.default_rng(47).integers(4, V_MODEL, PROMPT_LEN).tolist()])
    autospec.wrap(model, store=path)
    try:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                       do_sample=False)
    finally:
        autospec.unwrap(model)  # flushes the writer
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    (blob,) = db.execute("SELECT features FROM requests").fetchone()
    db.close()
    return ids[0].tolist(), bytes(blob), path


def test_the_attack_rebuilds_a_prompt_from_unkeyed_features(stored):
    prompt, _, _ = stored
    assert hashlib.sha256(unkeyed_features(range(100))).hexdigest()[:16] == OLD_GOLDEN
    walk, present, links = reconstruct(unkeyed_features(prompt), VOCAB_IDS.view(np.uint64))
    assert walk == prompt  # every token, in order
    assert set(prompt) <= present and set(zip(prompt, prompt[1:])) <= links


def test_the_attack_learns_nothing_from_a_stored_request(stored):
    prompt, blob, path = stored
    assert blob[0] == 2  # keyed; nothing else in the row holds the prompt (log_text is off)
    guesses = {
        "public hash": VOCAB_IDS.view(np.uint64),
        "keyed, zero key": FeatureKey(bytes(32)).labels(VOCAB_IDS),
        "keyed, a random key": FeatureKey.random().labels(VOCAB_IDS),
    }
    for name, labels in guesses.items():
        walk, present, links = reconstruct(blob, labels)
        found = present & set(prompt)
        true_links = links & set(zip(prompt, prompt[1:]))
        print(f"\n{name}: {len(present)} candidate ids, {len(found)} of them in the prompt, "
              f"{len(true_links)} true bigrams, longest shared run "
              f"{longest_shared_run(walk, prompt)}")
        assert len(found) <= 2, name  # chance: about 80 buckets of 2**18 per id
        assert len(true_links) <= 1, name
        assert longest_shared_run(walk, prompt) <= 2, name
    # with the key file (kept beside the store, not in it) the same attack reads it back
    key = FeatureKey(load_key(key_file_of(path), create=False))
    walk, _, _ = reconstruct(blob, key.labels(VOCAB_IDS))
    assert walk == prompt


def key_file_of(db_path) -> object:
    return db_path.with_name(db_path.name + ".feature-key")


# -- where the key lives ------------------------------------------------------------------------

def test_the_key_file_is_created_beside_the_store_private_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    db = tmp_path / "s.db"
    with open_store(db) as store:
        secret = store.feature_key()
    path = key_file_of(db)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert bytes.fromhex(path.read_text().strip()) == secret and len(secret) == 32
    with open_store(db) as store, open_store(db, read_only=True) as reader:
        assert store.feature_key() == reader.feature_key() == secret
    # a read-only store never creates a key; a copy of the store alone has none
    copy = tmp_path / "copy.db"
    copy.write_bytes(db.read_bytes())
    with open_store(copy, read_only=True) as reader, pytest.raises(FeatureKeyError,
                                                                 match="no feature key at"):
        reader.feature_key()
    assert not key_file_of(copy).exists()
    # a fleet shares one key file through the environment; it wins over the one beside
    shared = tmp_path / "fleet" / "key"
    monkeypatch.setenv(KEY_ENV, str(shared))
    with open_store(db) as one, open_store(tmp_path / "other.db") as two:
        assert one.feature_key() == two.feature_key() != secret
    assert stat.S_IMODE(shared.stat().st_mode) == 0o600


def test_server_stores_keep_their_key_in_the_cache_named_from_the_database(monkeypatch):
    from sqlalchemy.engine import make_url

    from autospec.store.database import cache_dir

    monkeypatch.delenv(KEY_ENV, raising=False)
    a = key_file(make_url("postgresql+psycopg://alice:secret@db.example:5432/autospec"))
    b = key_file(make_url("postgresql+psycopg://bob:other@db.example:5432/autospec"))
    c = key_file(make_url("postgresql+psycopg://alice:secret@db.example:5432/staging"))
    d = key_file(make_url("postgresql+psycopg://alice:secret@db.example:5432/autospec"
                          "?options=-csearch_path%3Dt1"))
    e = key_file(make_url("postgresql+psycopg://alice@/autospec?host=/run/pg&port=5433"))
    assert a == b != c != d != a != e  # one store, one key, whoever connects
    assert a.parent == cache_dir() / "feature-keys"
    assert "secret" not in str(a) and "alice" not in str(a)
    assert key_file(make_url("sqlite://")) is None  # in memory: a key of the Store alone


def test_processes_creating_the_key_at_once_agree(tmp_path):
    path = tmp_path / "race.key"
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(load_key(path, create=True)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["race.key"]  # no temporary left behind


def test_a_damaged_key_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.key"
    path.write_text("not hex\n")
    with pytest.raises(FeatureKeyError, match="is not a feature key .*64 hex digits"):
        load_key(path, create=True)
    assert path.read_text() == "not hex\n"  # never overwritten


# -- serving without a usable key ---------------------------------------------------------------

def test_serving_goes_on_without_features_where_the_key_cannot_be_created(tmp_path, caplog):
    db = tmp_path / "s.db"
    key_file_of(db).mkdir()  # the key's path is taken: it can be neither read nor created
    model = tiny()
    ids = torch.tensor([[1, 10, 11, 12, 13, 10, 11]])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                         do_sample=False)
    with caplog.at_level(logging.WARNING, logger="autospec"):
        ctrl = autospec.wrap(model, store=db)
        try:
            outs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                   do_sample=False) for _ in range(3)]
        finally:
            autospec.unwrap(model)
    assert all(torch.equal(out, ref) for out in outs)
    assert ctrl.features_skipped == 3 and ctrl.feature_key is None
    warned = [r for r in caplog.records if "prompt features are off" in r.getMessage()]
    assert len(warned) == 1 and str(key_file_of(db)) in warned[0].getMessage()
    with open_store(db, read_only=True) as store, store.session() as s:
        rows = queries.recent_requests(s, limit=10)
    assert len(rows) == 3 and all(r.features is None for r in rows)


def test_features_without_a_store_use_the_fleet_key_or_one_of_their_own(tmp_path,
                                                                          monkeypatch):
    model = tiny()
    from autospec.controller import Controller

    monkeypatch.delenv(KEY_ENV, raising=False)
    cat = _categorizer(key_id=None)
    mine = Controller(model, store=False, categorize=cat)
    other = Controller(model, store=False, categorize=cat)
    assert mine.feature_key.id != other.feature_key.id  # a process's own: random
    path = tmp_path / "fleet.key"
    monkeypatch.setenv(KEY_ENV, str(path))
    with pytest.raises(FeatureKeyError, match="no feature key at"):
        load_key(path, create=False)
    key = FeatureKey(load_key(path, create=True))
    fleet = Controller(model, store=False, categorize=_categorizer(key_id=key.id))
    assert fleet.feature_key.id == key.id
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match="was fitted on features under feature key"):
        Controller(model, store=False, categorize=_categorizer(key_id=key.id))


def _categorizer(key_id):
    from autospec.categorize.categorizer import Categorizer

    return Categorizer(name="fixed", version=1, kind="classifier", classes=["a", "b"],
                       columns=np.zeros(0, np.uint32), coef=np.zeros((2, 0)),
                       intercept=np.array([1.0, 0.0]), key_id=key_id)


def test_features_differ_by_key_and_carry_its_id():
    a, b = FeatureKey(bytes(32)), FeatureKey(bytes([1]) * 32)
    assert prompt_features([5, 6, 7], a)[1:5] == a.id.to_bytes(4, "little")
    assert prompt_features([5, 6, 7], a)[5:] != prompt_features([5, 6, 7], b)[5:]


# -- clearing old features ----------------------------------------------------------------------

@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


def _files(url: str) -> bytes:
    path = url.removeprefix("sqlite:///")
    wal = f"{path}-wal"
    return open(path, "rb").read() + (open(wal, "rb").read() if os.path.exists(wal) else b"")


def test_forget_clears_unkeyed_features_and_keeps_the_rest(url, capsys):
    rng = random.Random(5)
    prompts = [rng.sample(range(4, V_MODEL), 30) for _ in range(6)]
    with open_store(url) as store:
        key = FeatureKey(store.feature_key())
        records = []
        for i, p in enumerate(prompts):  # odd ones as autospec logged them before keying
            rec = store_record(rng)
            rec.features = unkeyed_features(p) if i % 2 else prompt_features(p, key)
            records.append(rec)
        store.write(records)
    sqlite = url.startswith("sqlite")
    if sqlite:
        assert all(r.features in _files(url) for r in records)  # the check below can fail
    assert main(["categorize", "forget", "--db", url]) == 0
    assert "cleared the unkeyed prompt features of 3 request(s)" in capsys.readouterr().out
    with open_store(url, read_only=True) as store, store.session() as s:
        rows = sorted(queries.recent_requests(s, limit=10), key=lambda r: r.id)
    assert [r.features for r in rows] == [None if i % 2 else rec.features
                                          for i, rec in enumerate(records)]
    assert [r.category for r in rows] == [rec.category for rec in records]  # the rest stays
    if sqlite:  # overwritten in the file, not only unlinked from the row
        data = _files(url)
        assert not any(rec.features in data for rec in records[1::2])
    assert main(["categorize", "forget", "--db", url, "--all"]) == 0
    assert "cleared the prompt features of 3 request(s)" in capsys.readouterr().out
    with open_store(url, read_only=True) as store, store.session() as s:
        assert all(r.features is None for r in queries.recent_requests(s, limit=10))
