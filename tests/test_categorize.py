"""The traffic categoriser (autospec.categorize.categorizer) and `autospec categorize fit|show`.

A labelled synthetic corpus stands in for logged traffic: four categories whose prompts draw
token ids from overlapping Zipf distributions over a 5000-token vocabulary (60 % of tokens
from a shared distribution, the rest from a category-specific permutation, plus
category-specific bigrams), with a share of "easy" tokens common to all categories that
raises acceptance. Acceptance = category base + a term in that share, observed through a
64-position greedy trace. Real SQLite store, real scikit-learn, no mocks.

Stated accuracy: the held-out (newest 20 %) accuracy of the classifier is at least 0.90, and
so is its accuracy on a fresh sample of the same traffic; the acceptance forecast's held-out
MAE is below that of predicting the mean.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from autospec.categorize.categorizer import (
    FEATURE_VERSION,
    HEAD_TOKENS,
    N_BUCKETS,
    TAIL_TOKENS,
    Categorizer,
    FeatureKey,
    FitReport,
    decode_features,
    features_matrix,
    fit_categorizer,
    fit_from_store,
    prompt_features,
)
from autospec.cli import main
from autospec.cli.common import parse_when
from autospec.store import PairInfo, RequestRecord, open_store, queries
from autospec.store.queries import FeatureRow

from records import blocks, draft

ACCURACY = 0.90  # the stated accuracy on the labelled synthetic corpus
V = 5000
PAIR = PairInfo("org/target-1.5b", "org/draft-0.5b", "float32", "cpu: test")
OTHER_PAIR = PairInfo("org/target-7b", "org/draft-0.5b", "bfloat16", "cuda: test")
T0 = 1_750_000_000.0
KEY = FeatureKey(bytes(range(32)))  # a fixed key: features of fixed bytes


def key_of(url) -> FeatureKey:
    """The store's feature key (its key file), as serving and `categorize fit` use it."""
    with open_store(url) as store:
        return FeatureKey(store.feature_key())


class Traffic:
    """A fixed world of categories; ``sample`` draws prompts from it."""

    BASE = {"code": 0.80, "chat": 0.60, "translate": 0.45, "adversarial": 0.25}

    def __init__(self, seed: int = 0, categories: int = 4) -> None:
        rng = np.random.default_rng(seed)
        ranks = np.arange(V)
        self.zipf = 1 / (ranks + 10.0) ** 1.1
        self.zipf /= self.zipf.sum()
        self.names = list(self.BASE)[:categories]
        self.shared = rng.permutation(V)
        self.own = {c: rng.permutation(V) for c in self.names}
        self.successor = {c: rng.integers(0, V, V) for c in self.names}
        self.easy = rng.choice(V, 200, replace=False)

    def prompt(self, category: str, rng: np.random.Generator) -> tuple[np.ndarray, float]:
        n = int(rng.integers(16, 300))
        own = rng.random(n) < 0.4
        toks = np.where(own, self.own[category][rng.choice(V, n, p=self.zipf)],
                        self.shared[rng.choice(V, n, p=self.zipf)])
        follow = np.flatnonzero(rng.random(n) < 0.2)
        for j in follow[follow > 0]:
            toks[j] = self.successor[category][toks[j - 1]]
        share = rng.uniform(0.0, 0.3)
        easy = rng.random(n) < share
        toks[easy] = rng.choice(self.easy, int(easy.sum()))
        alpha = float(np.clip(self.BASE[category] + 0.6 * (share - 0.15)
                              + rng.normal(0, 0.02), 0.02, 0.98))
        return toks, alpha

    def sample(self, per_category: int, seed: int):
        """[(tokens, category, true acceptance)], categories interleaved at random."""
        rng = np.random.default_rng(seed)
        labels = rng.permutation(np.repeat(np.arange(len(self.names)), per_category))
        return [(*self.prompt(self.names[c], rng), self.names[c]) for c in labels]


def make_record(tokens, category, alpha, created_at, rng, *, key, source="given",
                pair=PAIR) -> RequestRecord:
    """A request whose greedy trace shows acceptance ~ ``alpha`` (k = 4 throughout)."""
    trace = (rng.random(64) < alpha).astype(np.uint8)
    acc = [int(trace[i:i + 4].sum()) for i in range(0, 64, 4)]
    return RequestRecord(
        pair=pair, category=category, policy="fixed(4)", greedy=True,
        prompt_tokens=len(tokens), new_tokens=64, iterations=16,
        proposers=draft(trace=trace.tobytes(), **blocks([4] * 16, acc)),
        k_schedule=bytes([4] * 16), accepted_schedule=bytes(acc), wall_s=0.5, prefill_s=0.01,
        draft_s=0.1, draft_forwards=64, target_s_by_n={5: [0.01] * 16}, trace_kind="greedy",
        created_at=created_at, category_source=source,
        features=prompt_features(tokens, key))


def write_corpus(store, samples, *, seed=1, source="given", start=T0, **kw) -> None:
    """Logged requests, their features under the store's own key (as serving logs them)."""
    rng = np.random.default_rng(seed)
    key = FeatureKey(store.feature_key())
    store.write([make_record(toks, cat if source == "given" else "default", a,
                             start + 60 * i, rng, source=source, key=key, **kw)
                 for i, (toks, a, cat) in enumerate(samples)])


@pytest.fixture(scope="module")
def world():
    return Traffic(seed=0)


@pytest.fixture(scope="module")
def labelled(world, tmp_path_factory):
    """A store holding 400 labelled requests (100 per category), fitted once."""
    url = f"sqlite:///{tmp_path_factory.mktemp('cat') / 'autospec.db'}"
    with open_store(url) as store:
        write_corpus(store, world.sample(100, seed=1))
        t = time.perf_counter()
        cat, report = fit_from_store(store)
        fit_s = time.perf_counter() - t
    print(f"\nfit on 400 requests: {fit_s:.2f} s; held-out accuracy {report.accuracy:.3f}, "
          f"MAE {report.mae:.3f} (mean {report.baseline_mae:.3f}, category mean "
          f"{report.category_mean_mae:.3f})")
    return url, cat, report


# -- features ---------------------------------------------------------------------------------

def test_features_are_deterministic_bounded_and_keyed():
    ids = np.random.default_rng(3).integers(0, 150_000, 50)
    blob = prompt_features(ids, KEY)
    assert blob == prompt_features(ids.tolist(), KEY) == prompt_features(ids[None, :], KEY)
    assert blob == prompt_features(ids.astype(np.int32), KEY)
    assert blob[0] == FEATURE_VERSION and (len(blob) - 5) % 6 == 0
    assert int.from_bytes(blob[1:5], "little") == KEY.id  # the key's id, not the key
    idx, counts = decode_features(blob)
    assert int(counts.sum()) == 50 + 49  # unigrams + bigrams
    assert np.all(idx < N_BUCKETS) and np.all(np.diff(idx.astype(np.int64)) > 0)
    assert prompt_features([], KEY) == bytes([FEATURE_VERSION]) + KEY.id.to_bytes(4, "little")
    assert decode_features(prompt_features([7], KEY))[1].tolist() == [1]
    # pinned: a change to the features must bump FEATURE_VERSION (stored models depend on it)
    assert hashlib.sha256(prompt_features(range(100), KEY)).hexdigest()[:16] == GOLDEN
    # another key: other buckets for the same prompt (almost none shared)
    other = FeatureKey(bytes(range(1, 33)))
    theirs, _ = decode_features(prompt_features(ids, other))
    assert other.id != KEY.id and np.intersect1d(idx, theirs).size <= 2
    # not Python's salted hash(): another process with another hash seed agrees
    code = ("import sys; from autospec.categorize.features import FeatureKey, "
            "prompt_features; sys.stdout.write(prompt_features(range(100), "
            "FeatureKey(bytes(range(32)))).hex()); "
            "assert 'torch' not in sys.modules and 'sklearn' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345"})
    assert bytes.fromhex(out.stdout) == prompt_features(range(100), KEY)
    # a huge prompt costs bounded space: head and tail only, no n-gram across the cut
    long = np.arange(100_000)
    idx, counts = decode_features(prompt_features(long, KEY))
    assert int(counts.sum()) == (HEAD_TOKENS + HEAD_TOKENS - 1) + (TAIL_TOKENS + TAIL_TOKENS - 1)
    middle = long.copy()
    middle[HEAD_TOKENS:-TAIL_TOKENS] = 42  # what lies between head and tail is not read
    assert prompt_features(middle, KEY) == prompt_features(long, KEY)
    # ids beyond the cached table and negative ones are labelled like any other, stably
    odd = [2**40, -3, 5, 2**40]
    assert prompt_features(odd, KEY) == prompt_features(odd, FeatureKey(bytes(range(32))))
    with pytest.raises(ValueError, match="one sequence"):
        prompt_features(np.zeros((2, 3), dtype=int), KEY)
    with pytest.raises(ValueError, match="integers"):
        prompt_features([0.5, 1.5], KEY)
    with pytest.raises(TypeError, match="FeatureKey"):
        prompt_features([1, 2], bytes(32))  # the secret itself is not a key object
    assert "FeatureKey(id=" in repr(KEY) and bytes(range(32)).hex() not in repr(KEY)


GOLDEN = "45931653aa992123"  # sha256 of prompt_features(range(100), KEY), feature version 2


def test_corrupt_unkeyed_and_other_key_features_are_refused():
    good = prompt_features([5, 6, 7, 8], KEY)
    n = (len(good) - 5) // 6
    idx = np.frombuffer(good, "<u4", n, 5)
    cases = {
        "empty": b"",
        "format version": bytes([FEATURE_VERSION + 1]) + good[1:],
        "unkeyed": bytes([1]) + good[5:],  # format 1: refused, whatever its bytes
        "5 \\+ 6": good[:-1],
        "strictly increasing": good[:5] + idx[::-1].astype("<u4").tobytes() + good[5 + 4 * n:],
        "zero count": good[:-2] + b"\x00\x00",
        "below": good[:5] + np.array([N_BUCKETS], "<u4").tobytes() + b"\x01\x00",
    }
    for match, blob in cases.items():
        with pytest.raises(ValueError, match=match):
            decode_features(blob)
    with pytest.raises(ValueError, match="must be bytes"):
        decode_features("text")
    with pytest.raises(ValueError, match=f"under feature key {KEY.id:08x}, not"):
        decode_features(good, key_id=KEY.id ^ 1)
    cat = Categorizer(name="x", version=None, kind="classifier", classes=["a"],
                      columns=np.zeros(0), coef=np.zeros((1, 0)), intercept=np.zeros(1))
    with pytest.raises(ValueError, match="format version"):
        cat.predict(cases["format version"])
    with pytest.raises(ValueError, match="format version"):
        features_matrix([good, cases["format version"]])
    # a categoriser fitted under one key refuses another key's features; unkeyed: any key
    keyed = Categorizer(name="x", version=2, kind="classifier", classes=["a"],
                        columns=np.zeros(0), coef=np.zeros((1, 0)), intercept=np.zeros(1),
                        key_id=KEY.id ^ 1)
    with pytest.raises(ValueError, match="another server's key file"):
        keyed.predict(good)
    with pytest.raises(ValueError, match="refit it"):
        keyed.check_key(KEY)
    assert cat.predict(good) == ("a", None)
    cat.check_key(KEY)


# -- the labelled corpus ----------------------------------------------------------------------

def test_classifier_reaches_the_stated_accuracy(labelled, world):
    url, cat, report = labelled
    assert cat.kind == "classifier" and sorted(cat.classes) == sorted(world.names)
    assert report.rows == 400 and report.test_rows == 80 and report.split == "time"
    assert report.accuracy >= ACCURACY
    assert set(report.per_class) == set(world.names)
    assert all(m["recall"] >= 0.75 for m in report.per_class.values())
    assert sum(map(sum, report.confusion)) == 80
    # a fresh sample of the same traffic, through the stored model's own predict
    fresh = world.sample(50, seed=99)
    key = key_of(url)
    got = cat.predict_many([prompt_features(t, key) for t, _, _ in fresh])
    accuracy = np.mean([g == c for (g, _), (_, _, c) in zip(got, fresh)])
    assert accuracy >= ACCURACY
    # the acceptance forecast beats predicting the mean, on held-out rows and on fresh ones
    assert report.mae < report.baseline_mae
    assert report.mae < 0.7 * report.baseline_mae
    truth = np.array([a for _, a, _ in fresh])
    forecast = np.array([a for _, a in got])
    assert np.all((forecast >= 0) & (forecast <= 1))
    assert np.mean(np.abs(forecast - truth)) < 0.7 * np.mean(np.abs(truth.mean() - truth))
    # the meta says what it was fitted on
    meta = cat.meta
    assert meta["window"]["rows"] == 400 and meta["window"]["labels"] == {c: 100 for c in
                                                                          world.names}
    assert meta["features"] == {"version": FEATURE_VERSION, "key_id": key.name,
                                "buckets": N_BUCKETS,
                                "ngrams": [1, 2], "head_tokens": HEAD_TOKENS,
                                "tail_tokens": TAIL_TOKENS,
                                "weighting": "log1p(count), rows l2-normalised"}
    assert meta["window"]["first"].startswith("2025-06-15") and meta["sklearn"]
    assert meta["regressor"]["fitted"] and meta["regressor"]["pair_id"] == cat.regressor_pair_id
    assert json.loads(json.dumps(meta)) == meta


def test_stored_model_round_trips(labelled, world):
    url, cat, report = labelled
    key = key_of(url)
    blobs = [prompt_features(t, key) for t, _, _ in world.sample(10, seed=5)]
    with open_store(url) as store:
        loaded = Categorizer.load(store)
        assert loaded.version == report.version == 1 and loaded.kind == "classifier"
        assert loaded.predict_many(blobs) == cat.predict_many(blobs)
        assert loaded.meta == cat.meta
        assert FitReport.from_meta(loaded.meta, loaded.version) == report
        assert Categorizer.load(store, name="nobody") is None
        assert Categorizer.load(store, version=7) is None
    clone = Categorizer.from_payload(cat.to_payload(), name="c", version=3, kind=cat.kind)
    assert clone.predict_many(blobs) == cat.predict_many(blobs)
    assert clone.key_id == loaded.key_id == cat.key_id == key.id  # the key's id travels
    with pytest.raises(ValueError, match="another server.s key file"):
        clone.predict(prompt_features(world.sample(1, seed=6)[0][0], KEY))
    with pytest.raises(ValueError, match="unreadable payload"):
        Categorizer.from_payload(b"not an npz", name="c", version=1, kind="classifier")
    arrays = dict(np.load(io.BytesIO(cat.to_payload())))
    arrays["feature_version"] = np.array(FEATURE_VERSION + 1)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with pytest.raises(ValueError, match="refit"):
        Categorizer.from_payload(buf.getvalue(), name="c", version=1, kind="classifier")


def test_own_predictions_equal_scikit_learn(labelled, world):
    from sklearn.cluster import KMeans, MiniBatchKMeans
    from sklearn.decomposition import TruncatedSVD
    from sklearn.linear_model import LogisticRegression, Ridge

    url, cat, _ = labelled
    with open_store(url) as store, store.session() as s:
        rows = list(queries.feature_rows(s))
    X = features_matrix([r.features for r in rows])
    y = np.array([r.category for r in rows])
    fresh = [prompt_features(t, key_of(url)) for t, _, _ in world.sample(25, seed=7)]
    Xf = features_matrix(fresh)
    # the fitted categoriser against scikit-learn fitted the same way on every bucket
    sk = LogisticRegression(C=10.0, solver="sag", max_iter=1000, random_state=0).fit(X, y)
    assert [c for c, _ in cat.predict_many(fresh)] == sk.predict(Xf).tolist()
    proba = np.array([[cat.probabilities(b)[c] for c in sk.classes_] for b in fresh])
    np.testing.assert_allclose(proba, sk.predict_proba(Xf), atol=1e-3)
    used = np.unique(X.indices)  # below: only the buckets the corpus uses (faster)
    X, Xf = X[:, used], Xf[:, used]
    # the conversion itself, exactly: multinomial, binary, k-means, and the ridge forecast
    acc = np.array([r.acceptance for r in rows])
    for labels in (y, np.where(y == "code", "code", "other")):
        clf = LogisticRegression(C=3.0, solver="sag", max_iter=500, random_state=1).fit(X, labels)
        means = {c: acc[labels == c].mean() for c in clf.classes_}
        ridge = Ridge(alpha=0.3).fit(X, acc - np.array([means[c] for c in labels]))
        own = Categorizer.from_sklearn(clf, ridge, columns=used,
                                       class_alpha=[means[c] for c in clf.classes_])
        pred = own.predict_many(fresh)
        assert [c for c, _ in pred] == clf.predict(Xf).tolist()
        proba = np.array([[own.probabilities(b)[c] for c in clf.classes_] for b in fresh])
        np.testing.assert_allclose(proba, clf.predict_proba(Xf), atol=1e-5)
        want = np.clip([means[c] for c in clf.predict(Xf)] + ridge.predict(Xf), 0, 1)
        np.testing.assert_allclose([a for _, a in pred], want, atol=1e-5)
    km = MiniBatchKMeans(n_clusters=4, random_state=0, n_init=3).fit(X)
    own = Categorizer.from_sklearn(km, columns=used)
    assert own.kind == "clusters" and own.predict(fresh[0])[1] is None
    assert [c for c, _ in own.predict_many(fresh)] == [f"cluster-{i}" for i in km.predict(Xf)]
    svd = TruncatedSVD(n_components=12, random_state=0).fit(X)
    km = KMeans(n_clusters=4, random_state=0, n_init=3).fit(svd.transform(X))
    own = Categorizer.from_sklearn(km, columns=used, projection=svd.components_)
    assert [c for c, _ in own.predict_many(fresh)] == [
        f"cluster-{i}" for i in km.predict(svd.transform(Xf))]
    with pytest.raises(ValueError, match="not for clusters"):
        own.probabilities(fresh[0])


def test_too_few_rows_is_a_clear_error(world, tmp_path):
    with open_store(tmp_path / "few.db") as store:
        write_corpus(store, world.sample(3, seed=2))  # 12 requests
        with pytest.raises(ValueError, match=r"^12 logged requests .* at least 20"):
            fit_from_store(store)
        with store.session() as s:
            assert queries.categorizers(s) == []
    rows = [FeatureRow(1, None, "a", "given", 1, b"\x09junk", 0.5)] * 30
    with pytest.raises(ValueError, match=r"^0 logged requests .*\(30 more skipped: 30 "
                                         r"unreadable\)"):
        fit_categorizer(rows, key_id=KEY.id)


def test_fit_reads_only_the_stores_key_and_counts_what_it_skips(world, tmp_path, caplog,
                                                              capsys):
    import logging

    db = tmp_path / "keys.db"
    rng = np.random.default_rng(8)
    with open_store(db) as store:
        write_corpus(store, world.sample(10, seed=31))  # 40 under the store's own key
        other = [make_record(t, c, a, T0 + 1e5 + i, rng, key=KEY)  # 20 under another key
                 for i, (t, a, c) in enumerate(world.sample(5, seed=32))]
        unkeyed = [make_record(t, c, a, T0 + 2e5 + i, rng, key=KEY)
                   for i, (t, a, c) in enumerate(world.sample(5, seed=33))]
        for rec in unkeyed:  # 20 in format 1, as autospec logged them before keying
            rec.features = b"\x01" + rec.features[5:]
        store.write(other + unkeyed)
        with caplog.at_level(logging.WARNING, logger="autospec.categorize"):
            cat, report = fit_from_store(store, min_rows=20, save=False)
        own = FeatureKey(store.feature_key())
    assert report.rows == 40 and report.skipped == {"other key": 20, "unkeyed": 20}
    assert cat.key_id == own.id and cat.meta["features"]["key_id"] == own.name
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped")]
    assert len(notes) == 2 and any("categorize forget" in n for n in notes)
    # a copy of the store without its key file: fit says what to do, and makes no key
    copy = tmp_path / "copy.db"
    copy.write_bytes(db.read_bytes())
    assert _cli(["categorize", "fit", "--db", str(copy)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autospec: error: no feature key at") and err.count("\n") == 1
    assert not (tmp_path / "copy.db.feature-key").exists()


def test_regressor_learns_one_pair_and_skips_unreadable_rows(world):
    from datetime import datetime, timezone

    rng = np.random.default_rng(4)
    rows = []
    for i, (toks, a, cat) in enumerate(world.sample(15, seed=11)):
        pair = 2 if i % 3 == 0 else 1  # pair 2: fewer rows, a different acceptance
        rows.append(FeatureRow(i, datetime.fromtimestamp(T0 + i, timezone.utc), cat, "given",
                               pair, prompt_features(toks, KEY),
                               float(np.clip(a if pair == 1 else 1 - a + rng.normal(0, .01),
                                             0, 1))))
    rows.append(rows[0]._replace(id=999, features=b"\x02"))
    cat, report = fit_categorizer(rows, key_id=KEY.id, seed=1)
    assert report.rows == 60 and report.skipped_rows == 1
    assert cat.regressor_pair_id == report.regressor_pair_id == 1
    assert report.regressor_rows == 40 and report.pair_ids == [1, 2]
    assert cat.meta["regressor"]["class_alpha"]["code"] > cat.meta["regressor"][
        "class_alpha"]["adversarial"]
    few, rep = fit_categorizer(rows, key_id=KEY.id, min_rows=50)
    assert not few.has_regressor and few.predict(rows[1].features)[1] is None
    assert "fewer than 50" in rep.regressor_note


def test_unlabelled_traffic_is_clustered(world, tmp_path):
    from sklearn.metrics import adjusted_rand_score

    with open_store(tmp_path / "plain.db") as store:
        samples = world.sample(40, seed=3)
        write_corpus(store, samples, source="default")
        cat, report = fit_from_store(store, name="plain", clusters=4)
        assert cat.kind == "clusters" and cat.classes == [f"cluster-{i}" for i in range(4)]
        assert report.silhouette is not None and -1 <= report.silhouette <= 1
        assert sum(report.cluster_sizes.values()) == 160 and report.version == 1
        assert report.labels == {"default": 160}
        key = FeatureKey(store.feature_key())
        got = [cat.predict(prompt_features(t, key))[0] for t, _, _ in samples]
        assert set(got) <= set(cat.classes)
        # the clusters recover the hidden categories (adjusted Rand index: 1 = identical
        # partitions, 0 = chance; k-means on the raw hashed n-grams reaches only 0.1-0.6 here)
        ari = adjusted_rand_score([c for _, _, c in samples], got)
        print(f"\nclusters vs hidden categories: adjusted Rand {ari:.2f}, silhouette "
              f"{report.silhouette:.2f}")
        assert ari >= 0.8
        assert cat.has_regressor  # acceptance still forecast, from the cluster means
        # no labels given and no --clusters: still clusters (default count)
        again, rep = fit_from_store(store, name="plain")
        assert again.kind == "clusters" and rep.version == 2 and rep.clusters == 8


# -- the CLI ----------------------------------------------------------------------------------

def _cli(argv):
    """The command's exit status, as the shell sees it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_cli_fit_and_show(labelled, world, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    with open_store(url) as store:
        write_corpus(store, world.sample(60, seed=21))  # 240 requests, one a minute
    assert _cli(["categorize", "fit", "--db", url, "--name", "web"]) == 0
    out = capsys.readouterr().out
    assert "stored as 'web' version 1" in out and "held-out accuracy: " in out
    accuracy = float(out.split("held-out accuracy: ")[1].split()[0])
    assert accuracy >= ACCURACY and "precision" in out and "MAE" in out
    # a window: the first 100 minutes only
    until = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(T0 + 60 * 100))
    assert _cli(["categorize", "fit", "--db", url, "--name", "web", "--until", until,
                 "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["version"] == 2 and fitted["report"]["rows"] == 100
    assert _cli(["categorize", "fit", "--db", url, "--name", "web", "--dry-run",
                 "--since", str(T0 + 60 * 200), "--min-rows", "50"]) == 1
    assert "40 logged requests" in capsys.readouterr().err
    assert _cli(["categorize", "show", "--db", url]) == 0
    out = capsys.readouterr().out
    assert "web" in out and "classifier" in out and out.index(" 2 ") < out.index(" 1 ")
    assert _cli(["categorize", "show", "--db", url, "--name", "web", "--version", "1"]) == 0
    assert "held-out accuracy: " in capsys.readouterr().out
    assert _cli(["categorize", "show", "--db", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [v["version"] for v in shown] == [2, 1]
    assert shown[1]["meta"]["window"]["rows"] == 240
    assert _cli(["categorize", "show", "--db", url, "--version", "9"]) == 1
    # a bad store: a clear message and exit code 2
    assert _cli(["categorize", "fit", "--db", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert _cli(["categorize", "show", "--db", "nosuchdriver://x"]) == 2
    assert "unknown database kind" in capsys.readouterr().err
    assert _cli(["categorize", "fit", "--since", "yesterday"]) == 2


def test_parse_when():
    assert parse_when("1700000000") == 1_700_000_000.0
    assert parse_when("2025-06-01").isoformat() == "2025-06-01T00:00:00+00:00"
    assert parse_when("2025-06-01T12:00:00Z").isoformat() == "2025-06-01T12:00:00+00:00"
    assert parse_when("2025-06-01T12:00+02:00").utcoffset().total_seconds() == 7200
    with pytest.raises(argparse.ArgumentTypeError, match="ISO"):
        parse_when("last tuesday")
