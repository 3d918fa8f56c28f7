"""Categories for unlabelled traffic, and a forecast of the acceptance a prompt will see.

A request that arrives without ``category=`` is given one before generation by a model fitted
on logged traffic that did carry a label, and a regressor predicts its acceptance so that the
policy starts from a good k instead of the global prior.

Features come from the prompt's **token ids** (never its text), keyed by the store's secret
feature key: ``autospec.categorize.features`` (``prompt_features``) says how, and
docs/store.md what a reader of the store can and cannot learn from them. A categoriser
remembers the id of the key it was fitted under and refuses features of another.

Models are linear on log(1 + count) weights with l2-normalised rows (``features_matrix``):
a multinomial logistic regression when the logged traffic has two or more labels, else
k-means clusters (on a truncated SVD, which keeps the nearest centre a linear function of
the features) named ``cluster-0``…; and a ridge regressor of the trace acceptance, clipped
to [0, 1]. A fitted ``Categorizer`` holds only numpy arrays (the coefficients of the columns
the training data used), is stored as an ``.npz`` loaded with ``allow_pickle=False``, and
predicts with one small dense product: no scikit-learn (and no pickle) at serving time.
scikit-learn is imported only by the fitting functions. No torch import.
"""

from __future__ import annotations

import io
import logging
import time
import zipfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from autospec.categorize.features import (
    FEATURE_VERSION,
    HEAD_TOKENS,
    N_BUCKETS,
    NGRAMS,
    TAIL_TOKENS,
    FeatureKey,
    FeaturesUnusable,
    _weights,
    decode_features,
    features_matrix,
    prompt_features,
)

log = logging.getLogger(__name__)

__all__ = [
    "FEATURE_VERSION", "N_BUCKETS", "HEAD_TOKENS", "TAIL_TOKENS", "FeatureKey",
    "FeaturesUnusable", "prompt_features", "decode_features", "features_matrix", "Categorizer",
    "FitReport", "fit_categorizer", "fit_from_store",
]

PAYLOAD_FORMAT = 1


# -- the fitted model -------------------------------------------------------------------------

class Categorizer:
    """A fitted categoriser, applied with numpy alone.

    category = argmax(coef · x + intercept) over the stored bucket ``columns``; for
    ``kind == "clusters"`` the rows of ``coef`` are the k-means centres and the intercept is
    −½‖centre‖², so the argmax is the nearest centre. Predicted acceptance (when a regressor
    was fitted) = clip(class_alpha[category] + reg_coef · x + reg_intercept, 0, 1): the
    category's mean acceptance, corrected by a ridge fit of each prompt's deviation from it.
    ``meta`` is what the store keeps beside the payload: the data it was fitted on (window,
    pairs, labels), the feature spec and the held-out metrics. ``key_id``: the id of the
    feature key the features it was fitted on were computed under; it refuses features of
    another key (None: any key, for a model built by hand)."""

    def __init__(self, *, name: str, version: int | None, kind: str, classes: Sequence[str],
                 columns: np.ndarray, coef: np.ndarray, intercept: np.ndarray,
                 reg_coef: np.ndarray | None = None, reg_intercept: float = 0.0,
                 class_alpha: np.ndarray | None = None,
                 meta: dict[str, Any] | None = None, key_id: int | None = None) -> None:
        if kind not in ("classifier", "clusters"):
            raise ValueError(f"categoriser kind must be 'classifier' or 'clusters', got {kind!r}")
        self.name = name
        self.version = version
        self.kind = kind
        self.key_id = None if key_id is None else int(key_id)
        from autospec.store.record import check_category

        self.classes = [check_category(str(c)) for c in classes]
        self.columns = np.ascontiguousarray(columns, dtype=np.uint32)
        coef = np.asarray(coef, dtype=np.float32)
        self.intercept = np.ascontiguousarray(intercept, dtype=np.float64)
        self.reg_coef = None if reg_coef is None else np.ascontiguousarray(reg_coef, np.float32)
        self.reg_intercept = float(reg_intercept)
        c, m = len(self.classes), self.columns.size
        if class_alpha is None:
            class_alpha = np.zeros(c)
        self.class_alpha = np.ascontiguousarray(class_alpha, dtype=np.float64)
        self.meta = dict(meta or {})
        if c < 1 or coef.shape != (c, m) or self.intercept.shape != (c,):
            raise ValueError(f"categoriser arrays disagree: {c} classes, {m} columns, coef "
                             f"{coef.shape}, intercept {self.intercept.shape}")
        if self.reg_coef is not None and self.reg_coef.shape != (m,):
            raise ValueError(f"regressor coef {self.reg_coef.shape} for {m} columns")
        if self.class_alpha.shape != (c,):
            raise ValueError(f"class_alpha {self.class_alpha.shape} for {c} classes")
        if m and (self.columns[-1] >= N_BUCKETS or np.any(self.columns[1:] <= self.columns[:-1])):
            raise ValueError("categoriser columns must be strictly increasing bucket indices")
        self._coef_t = np.ascontiguousarray(coef.T)  # predict gathers rows of it
        # bucket → column position (−1: unused); 1 MB, one lookup instead of a binary search
        self._lookup = np.full(N_BUCKETS, -1, dtype=np.int32)
        self._lookup[self.columns] = np.arange(m, dtype=np.int32)

    def __repr__(self) -> str:
        key = "any" if self.key_id is None else f"{self.key_id:08x}"
        return (f"Categorizer({self.name!r}, version={self.version}, kind={self.kind!r}, "
                f"classes={len(self.classes)}, columns={self.columns.size}, "
                f"regressor={self.reg_coef is not None}, key={key})")

    @property
    def coef(self) -> np.ndarray:
        """(classes, columns) float32: one row of weights per category."""
        return self._coef_t.T

    @property
    def has_regressor(self) -> bool:
        return self.reg_coef is not None

    @property
    def regressor_pair_id(self) -> int | None:
        """The model pair whose acceptance the regressor learnt (acceptance depends on it)."""
        return (self.meta.get("regressor") or {}).get("pair_id")

    def check_key(self, key: FeatureKey | None) -> None:
        """ValueError unless features computed under ``key`` are what this was fitted on."""
        if self.key_id is None:
            return
        if key is None or key.id != self.key_id:
            have = "no feature key" if key is None else f"feature key {key.name}"
            raise ValueError(
                f"categoriser {self.name!r} version {self.version} was fitted on features "
                f"under feature key {self.key_id:08x}, and this process has {have} (another "
                "server's key file, or a key rotated since): refit it with `autospec "
                "categorize fit`, or serve with the key it was fitted under "
                "($AUTOSPEC_FEATURE_KEY_FILE, docs/store.md)")

    def _project(self, blob: bytes) -> tuple[np.ndarray, np.ndarray]:
        idx, counts = decode_features(blob, self.key_id)
        w = _weights(counts)  # normalised over every n-gram, as at fit time
        if not idx.size or not self.columns.size:
            return np.zeros(0, np.intp), w[:0]
        pos = self._lookup[idx]
        hit = pos >= 0
        return pos[hit], w[hit]

    def _scores(self, pos: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w @ self._coef_t[pos] + self.intercept  # rows of the transpose: one gather

    def _alpha(self, k: int, pos: np.ndarray, w: np.ndarray) -> float | None:
        if self.reg_coef is None:
            return None
        a = self.class_alpha[k] + float(self.reg_coef[pos] @ w) + self.reg_intercept
        return min(1.0, max(0.0, a))

    def predict(self, blob: bytes) -> tuple[str, float | None]:
        """(category, predicted acceptance or None without a regressor) for encoded features.
        FeaturesUnusable (a ValueError) if ``blob`` is not features of this FEATURE_VERSION
        under the key it was fitted under."""
        pos, w = self._project(blob)
        k = int(np.argmax(self._scores(pos, w)))
        return self.classes[k], self._alpha(k, pos, w)

    def predict_many(self, blobs: Iterable[bytes]) -> list[tuple[str, float | None]]:
        return [self.predict(b) for b in blobs]

    def probabilities(self, blob: bytes) -> dict[str, float]:
        """Class probabilities (classifier only): softmax of the scores, which equals
        scikit-learn's ``predict_proba`` (binary: [1 − σ(z), σ(z)])."""
        if self.kind != "classifier":
            raise ValueError("probabilities are defined for a classifier, not for clusters")
        s = self._scores(*self._project(blob))
        p = np.exp(s - s.max())
        p /= p.sum()
        return dict(zip(self.classes, p.tolist()))

    # -- persistence --------------------------------------------------------------------------

    def to_payload(self) -> bytes:
        arrays: dict[str, np.ndarray] = {
            "format": np.array(PAYLOAD_FORMAT, np.int64),
            "feature_version": np.array(FEATURE_VERSION, np.int64),
            "n_buckets": np.array(N_BUCKETS, np.int64),
            "key_id": np.array(-1 if self.key_id is None else self.key_id, np.int64),
            "classes": np.array(self.classes, dtype=np.str_),
            "columns": self.columns, "coef": self.coef, "intercept": self.intercept,
        }
        if self.reg_coef is not None:
            arrays["reg_coef"] = self.reg_coef
            arrays["reg_intercept"] = np.array(self.reg_intercept, np.float64)
            arrays["class_alpha"] = self.class_alpha
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_payload(cls, payload: bytes, *, name: str, version: int | None, kind: str,
                     meta: dict[str, Any] | None = None) -> Categorizer:
        """ValueError if the payload is corrupt or made for other features (refit then)."""
        where = f"categoriser {name!r} version {version}"
        try:
            with np.load(io.BytesIO(bytes(payload)), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{where}: unreadable payload ({exc})") from None
        missing = {"format", "feature_version", "n_buckets", "classes", "columns", "coef",
                   "intercept"} - set(arrays)
        if missing:
            raise ValueError(f"{where}: payload lacks {sorted(missing)}")
        if int(arrays["format"]) != PAYLOAD_FORMAT:
            raise ValueError(f"{where}: payload format {int(arrays['format'])}, this autospec "
                             f"reads {PAYLOAD_FORMAT}")
        fv, nb = int(arrays["feature_version"]), int(arrays["n_buckets"])
        if fv != FEATURE_VERSION or nb != N_BUCKETS:
            raise ValueError(f"{where} was fitted on features v{fv} ({nb} buckets); this "
                             f"autospec computes v{FEATURE_VERSION} ({N_BUCKETS} buckets): "
                             "refit with `autospec categorize fit`")
        reg = arrays.get("reg_coef")
        key_id = int(arrays["key_id"]) if "key_id" in arrays else -1
        try:
            return cls(name=name, version=version, kind=kind,
                       key_id=None if key_id < 0 else key_id,
                       classes=arrays["classes"].tolist(), columns=arrays["columns"],
                       coef=arrays["coef"], intercept=arrays["intercept"], reg_coef=reg,
                       reg_intercept=float(arrays["reg_intercept"]) if reg is not None else 0.0,
                       class_alpha=arrays.get("class_alpha"), meta=meta)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: inconsistent payload ({exc})") from None

    @classmethod
    def load(cls, store, name: str = "default", version: int | None = None,
             ) -> Categorizer | None:
        """The stored categoriser ``name`` (its latest version, or ``version``); None if there
        is none. ValueError if the stored one cannot be used by this autospec."""
        from autospec.store import queries

        with store.session() as s:
            row = queries.latest_categorizer(s, name=name, version=version)
        if row is None:
            return None
        return cls.from_payload(row.payload, name=row.name, version=row.version, kind=row.kind,
                                meta=row.meta)

    def save(self, store) -> int:
        """Store as the next version of ``self.name``; sets and returns ``self.version``."""
        from autospec.store import add_categorizer

        with store.begin() as s:
            _, version = add_categorizer(s, name=self.name, kind=self.kind,
                                         payload=self.to_payload(), meta=self.meta)
        self.version = version
        log.info("stored categoriser %r version %d (%s, %d classes)", self.name, version,
                 self.kind, len(self.classes))
        return version

    @classmethod
    def from_sklearn(cls, model, regressor=None, *, columns: np.ndarray | None = None,
                     projection: np.ndarray | None = None,
                     class_alpha: Sequence[float] | None = None, name: str = "default",
                     version: int | None = None, meta: dict[str, Any] | None = None,
                     key_id: int | None = None) -> Categorizer:
        """From a fitted linear classifier (``coef_``, ``intercept_``, ``classes_``, e.g.
        LogisticRegression) or k-means (``cluster_centers_``), and optionally a fitted linear
        regressor of the acceptance's deviation from ``class_alpha`` (``coef_``,
        ``intercept_``, e.g. Ridge), all trained on ``features_matrix(blobs)[:, columns]``
        (``columns`` default: every bucket). A k-means model may instead have been fitted on
        the projection ``X @ projection.T`` (e.g. TruncatedSVD's ``components_``): its nearest
        centre is still the argmax of a linear function of x. Columns whose coefficients are
        all zero are dropped (they add nothing). ``key_id``: the feature key the training
        features were computed under (None: predict accepts any key's)."""
        cols = np.arange(N_BUCKETS) if columns is None else np.asarray(columns, np.int64)
        if hasattr(model, "cluster_centers_"):
            kind = "clusters"
            centres = np.asarray(model.cluster_centers_, np.float64)
            # argmin ‖Px − c‖² = argmax (Pᵀc)·x − ½‖c‖²  (‖Px‖² is the same for every c)
            intercept = -0.5 * np.einsum("ij,ij->i", centres, centres)
            coef = centres if projection is None else centres @ np.asarray(projection,
                                                                           np.float64)
            classes = [f"cluster-{i}" for i in range(coef.shape[0])]
        else:
            kind = "classifier"
            coef = np.asarray(model.coef_, np.float64)
            intercept = np.asarray(model.intercept_, np.float64).reshape(-1)
            classes = [str(c) for c in model.classes_]
            if coef.shape[0] == 1 and len(classes) == 2:  # binary: z > 0 means classes[1]
                coef = np.vstack([np.zeros_like(coef), coef])
                intercept = np.array([0.0, intercept[0]])
        if coef.shape[1] != cols.size:
            raise ValueError(f"model has {coef.shape[1]} features for {cols.size} columns")
        used = np.any(coef != 0, axis=0)
        reg = None
        if regressor is not None:
            reg = np.asarray(regressor.coef_, np.float64).reshape(-1)
            used |= reg != 0
        keep = np.flatnonzero(used)
        return cls(name=name, version=version, kind=kind, classes=classes, columns=cols[keep],
                   coef=coef[:, keep], intercept=intercept,
                   reg_coef=None if reg is None else reg[keep],
                   reg_intercept=0.0 if regressor is None
                   else float(np.asarray(regressor.intercept_).reshape(-1)[0]),
                   class_alpha=None if class_alpha is None else np.asarray(class_alpha),
                   meta=meta, key_id=key_id)


# -- fitting ----------------------------------------------------------------------------------

@dataclass
class FitReport:
    """What a fit saw and how well it did (held-out figures are from a model fitted on the
    older rows and scored on the newest ``test_fraction``; the stored model is refitted on
    every row)."""

    name: str
    kind: str  # "classifier" or "clusters"
    rows: int
    labels: dict[str, int]  # label → rows (given categories of the rows fitted on)
    window_first: str | None  # ISO times of the oldest / newest row
    window_last: str | None
    pair_ids: list[int]
    split: str  # "time": newest rows held out; "shuffled": seeded random (see meta)
    train_rows: int
    test_rows: int
    accuracy: float | None = None  # classifier, held out
    per_class: dict[str, dict[str, float]] = field(default_factory=dict)
    confusion_labels: list[str] = field(default_factory=list)
    confusion: list[list[int]] = field(default_factory=list)  # rows: true, columns: predicted
    clusters: int | None = None
    silhouette: float | None = None
    cluster_sizes: dict[str, int] = field(default_factory=dict)
    regressor_rows: int = 0
    regressor_pair_id: int | None = None
    mae: float | None = None  # held-out acceptance MAE of the regressor
    baseline_mae: float | None = None  # … of predicting the training mean
    category_mean_mae: float | None = None  # … of predicting the training mean of the label
    regressor_note: str = ""
    skipped_rows: int = 0  # rows whose features could not be used
    # why, per kind: "unkeyed" (format 1), "other key", "unreadable"
    skipped: dict[str, int] = field(default_factory=dict)
    fit_s: float = 0.0
    version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], version: int | None = None) -> FitReport:
        d = dict(meta.get("report") or {})
        if version is not None:
            d["version"] = version
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def _default_clusters(n_rows: int) -> int:
    return max(2, min(8, n_rows // 20))


def _time_split(n: int, test_fraction: float) -> int:
    """Rows [0, n_train) train, [n_train, n) test."""
    if test_fraction <= 0:
        return n
    n_test = max(1, int(round(n * test_fraction)))
    return max(1, n - n_test)


def _compact(X_full) -> tuple[Any, np.ndarray]:
    """X restricted to the buckets some row uses (the others would get zero coefficients
    anyway; dropping them makes the fit several times faster), and those buckets."""
    import scipy.sparse as sp

    columns = np.unique(X_full.indices)
    indices = np.searchsorted(columns, X_full.indices).astype(np.int32)
    X = sp.csr_matrix((X_full.data, indices, X_full.indptr),
                      shape=(X_full.shape[0], columns.size))
    return X, columns


_SKIP_NOTES = {
    "unkeyed": "logged before features were keyed: readable back into tokens, no longer used; "
               "`autospec categorize forget` clears them",
    "other key": "computed under another feature key: another server's key file, or a key "
                 "rotated since (docs/store.md)",
    "unreadable": "unreadable",
}


def _usable_rows(rows: Iterable[Any], key_id: int) -> tuple[list[Any], dict[str, int]]:
    """The rows whose features this key reads, and how many were skipped, by kind (one
    logged line per kind)."""
    usable, skipped = [], Counter()
    for r in rows:
        try:
            decode_features(r.features, key_id)
        except FeaturesUnusable as exc:
            skipped[exc.kind] += 1
            if exc.kind == "unreadable" and skipped[exc.kind] <= 3:
                log.warning("request %s: skipping its prompt features: %s", r.id, exc)
            continue
        usable.append(r)
    for kind, n in sorted(skipped.items()):
        log.warning("skipped %d request(s) whose prompt features are %s", n,
                    _SKIP_NOTES.get(kind, kind))
    return usable, dict(sorted(skipped.items()))


def fit_categorizer(rows: Iterable[Any], *, key_id: int, name: str = "default",
                    clusters: int | None = None, test_fraction: float = 0.2, seed: int = 0,
                    min_rows: int = 20, classifier_c: float = 10.0, ridge_alpha: float = 0.3,
                    ) -> tuple[Categorizer, FitReport]:
    """Fit on the ``FeatureRow``s (``autospec.store.queries.feature_rows``) whose features
    were computed under the feature key ``key_id`` (the store's: ``FeatureKey.id``); rows
    of another key, unkeyed (format 1) or unreadable ones are skipped and counted.

    Two or more distinct labels and no ``clusters``: a multinomial logistic regression
    (``classifier_c``: inverse regularisation), scored on the newest ``test_fraction`` of the
    rows after fitting on the older ones (a seeded shuffled split if the older rows hold a
    single label), then refitted on all rows. Otherwise k-means with ``clusters`` centres
    (default: rows // 20, between 2 and 8) on a truncated SVD of the features, and the
    silhouette score there (−1..1).

    The acceptance regressor learns from the rows with an observed acceptance on one model
    pair (the commonest; acceptance depends on the pair): each category's mean acceptance
    plus a ridge fit (``ridge_alpha``) of the prompt's deviation from it, scored on the same
    held-out rows through the held-out classifier's categories. Left out with fewer than
    ``min_rows`` such rows. ValueError with fewer than ``min_rows`` usable rows."""
    import sklearn
    from sklearn.cluster import KMeans, MiniBatchKMeans
    from sklearn.decomposition import TruncatedSVD
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import (
        confusion_matrix,
        precision_recall_fscore_support,
        silhouette_score,
    )

    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if clusters is not None and clusters < 2:
        raise ValueError(f"clusters must be at least 2, got {clusters}")
    t0 = time.perf_counter()
    usable, by_kind = _usable_rows(rows, key_id)
    skipped = sum(by_kind.values())
    if len(usable) < max(2, min_rows):
        why = ", ".join(f"{n} {k}" for k, n in by_kind.items())
        raise ValueError(
            f"{len(usable)} logged requests with prompt features under this store's feature "
            f"key {key_id:08x}" + (f" ({skipped} more skipped: {why})" if skipped else "")
            + f"; fitting a categoriser needs at least {max(2, min_rows)}: serve more "
            "traffic with category= (features are logged by default) or widen the window")
    usable.sort(key=lambda r: (r.created_at, r.id))
    n = len(usable)
    X, columns = _compact(features_matrix([r.features for r in usable]))
    if columns.size < 3:
        raise ValueError(f"the {n} prompts fill only {columns.size} feature buckets (empty "
                         "prompts?); there is nothing to learn categories from")
    labels = np.array([r.category for r in usable], dtype=object)
    label_counts = dict(sorted(Counter(labels.tolist()).items(), key=lambda kv: (-kv[1], kv[0])))
    pair_ids = sorted({int(r.pair_id) for r in usable})

    n_train = _time_split(n, test_fraction)
    order, split = np.arange(n), "time"
    classify = clusters is None and len(label_counts) >= 2
    if classify and n_train < n and len(set(labels[:n_train])) < 2:
        order, split = np.random.default_rng(seed).permutation(n), "shuffled"
        log.info("the older rows carry a single label; holding out a seeded random %.0f%% "
                 "instead of the newest", 100 * test_fraction)
    train, test = np.sort(order[:n_train]), np.sort(order[n_train:])

    report = FitReport(name=name, kind="classifier" if classify else "clusters", rows=n,
                       labels=label_counts, window_first=_iso(usable[0].created_at),
                       window_last=_iso(usable[-1].created_at), pair_ids=pair_ids, split=split,
                       train_rows=int(train.size), test_rows=int(test.size),
                       skipped_rows=skipped, skipped=by_kind)
    projection = None
    predicted = np.empty(n, dtype=object)  # the category each held-out row was given
    model_meta: dict[str, Any]
    if classify:
        def classifier():
            # sag: fast on l2-normalised sparse rows (lbfgs is much slower here), seeded
            return LogisticRegression(C=classifier_c, solver="sag", max_iter=1000,
                                      random_state=seed)

        if test.size:
            held = classifier().fit(X[train], labels[train])
            predicted[test] = held.predict(X[test])
            every = sorted(set(labels[train]) | set(labels[test]))
            p, r_, f1, sup = precision_recall_fscore_support(
                labels[test], predicted[test], labels=every, zero_division=0)
            report.accuracy = float(np.mean(predicted[test] == labels[test]))
            report.per_class = {c: {"precision": float(p[i]), "recall": float(r_[i]),
                                    "f1": float(f1[i]), "support": int(sup[i])}
                                for i, c in enumerate(every)}
            report.confusion_labels = every
            report.confusion = confusion_matrix(labels[test], predicted[test],
                                                labels=every).tolist()
        model = classifier().fit(X, labels)
        groups = labels  # what the regressor's per-category means are taken over
        model_meta = {"estimator": "LogisticRegression", "C": classifier_c, "solver": "sag",
                      "seed": seed, "refit": "all rows"}
    else:
        k = clusters or _default_clusters(n)
        if k > n:
            raise ValueError(f"{k} clusters need at least {k} rows, got {n}")
        # k-means on a truncated SVD (LSA) of the features: on the raw hashed n-grams
        # distances are nearly all alike and clusters follow the categories far less well
        dims = max(1, min(max(8, 3 * k), 32, n - 1, X.shape[1] - 1))
        svd = TruncatedSVD(n_components=dims, random_state=seed)
        Z = svd.fit_transform(X)
        projection = svd.components_
        if n > 50_000:
            model = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=3,
                                    batch_size=4096).fit(Z)
        else:
            model = KMeans(n_clusters=k, random_state=seed, n_init=5).fit(Z)
        groups = np.array([f"cluster-{i}" for i in model.labels_], dtype=object)
        predicted[:] = groups  # unsupervised: the acceptance played no part
        report.clusters = k
        if len(set(model.labels_.tolist())) >= 2:
            report.silhouette = float(silhouette_score(
                Z, model.labels_, sample_size=min(n, 2000), random_state=seed))
        report.cluster_sizes = {f"cluster-{i}": int(c)
                                for i, c in enumerate(np.bincount(model.labels_, minlength=k))}
        composition = {f"cluster-{i}": dict(Counter(
            labels[model.labels_ == i].tolist()).most_common(5)) for i in range(k)}
        model_meta = {"estimator": f"{type(model).__name__} on TruncatedSVD({dims})",
                      "clusters": k, "seed": seed, "silhouette_space": f"SVD({dims})",
                      "refit": "all rows (unsupervised)", "label_composition": composition}
    classes = ([str(c) for c in model.classes_] if classify
               else [f"cluster-{i}" for i in range(model.cluster_centers_.shape[0])])

    regressor, class_alpha, reg_meta = _fit_regressor(
        usable, X, groups, predicted, train, test, classes, report, min_rows, ridge_alpha)
    report.fit_s = time.perf_counter() - t0
    meta = {
        "kind": report.kind,
        "features": {"version": FEATURE_VERSION, "key_id": f"{key_id:08x}",
                     "buckets": N_BUCKETS, "ngrams": list(NGRAMS),
                     "head_tokens": HEAD_TOKENS, "tail_tokens": TAIL_TOKENS,
                     "weighting": "log1p(count), rows l2-normalised"},
        "window": {"first": report.window_first, "last": report.window_last, "rows": n,
                   "labels": label_counts, "pair_ids": pair_ids, "skipped_rows": skipped,
                   "skipped": by_kind},
        "split": {"kind": split, "test_fraction": test_fraction, "train_rows": report.train_rows,
                  "test_rows": report.test_rows, "seed": seed},
        "model": model_meta,
        "regressor": reg_meta,
        "sklearn": sklearn.__version__,
        "numpy": np.__version__,
        "fitted_at": datetime.now(timezone.utc).isoformat(),
        "report": report.to_dict(),
    }
    cat = Categorizer.from_sklearn(model, regressor, columns=columns, projection=projection,
                                   class_alpha=class_alpha, name=name, meta=meta,
                                   key_id=key_id)
    log.info("fitted categoriser %r: %s on %d rows in %.2f s (%d columns)", name, report.kind,
             n, report.fit_s, cat.columns.size)
    return cat, report


def _category_means(y: np.ndarray, groups: np.ndarray) -> tuple[dict[Any, float], float]:
    sums: dict[Any, list[float]] = {}
    for g, v in zip(groups.tolist(), y.tolist()):
        sums.setdefault(g, []).append(v)
    return {g: float(np.mean(v)) for g, v in sums.items()}, float(y.mean())


def _fit_regressor(usable, X, groups, predicted, train, test, classes, report: FitReport,
                   min_rows: int, alpha: float) -> tuple[Any, np.ndarray | None, dict[str, Any]]:
    """Acceptance = mean of the category + ridge on the deviation from it (see
    ``fit_categorizer``); (ridge or None, per-class means over ``classes``, meta)."""
    from sklearn.linear_model import Ridge

    observed = Counter(int(r.pair_id) for r in usable if r.acceptance is not None)
    if not observed:
        report.regressor_note = "no request observed its acceptance"
        return None, None, {"fitted": False, "reason": report.regressor_note}
    pair_id = max(observed, key=lambda p: (observed[p], -p))
    if len(observed) > 1:
        log.info("acceptance depends on the model pair: fitting the regressor on pair %d "
                 "(%d of %d rows with an acceptance)", pair_id, observed[pair_id],
                 sum(observed.values()))
    report.regressor_pair_id = pair_id
    mask = np.array([r.acceptance is not None and int(r.pair_id) == pair_id for r in usable])
    y_all = np.array([r.acceptance if m else np.nan for r, m in zip(usable, mask)])
    rows = np.flatnonzero(mask)
    if rows.size < max(2, min_rows):
        report.regressor_note = (f"{rows.size} rows with an observed acceptance on pair "
                                 f"{pair_id}, fewer than {max(2, min_rows)}")
        return None, None, {"fitted": False, "reason": report.regressor_note,
                            "pair_id": pair_id}
    tr, te = train[mask[train]], test[mask[test]]
    if tr.size >= 2 and te.size:
        means, overall = _category_means(y_all[tr], groups[tr])
        base = np.array([means.get(g, overall) for g in groups[tr]])
        held = Ridge(alpha=alpha).fit(X[tr], y_all[tr] - base)
        prior = np.array([means.get(g, overall) for g in predicted[te]])
        pred = np.clip(prior + held.predict(X[te]), 0.0, 1.0)
        report.mae = float(np.mean(np.abs(pred - y_all[te])))
        report.baseline_mae = float(np.mean(np.abs(overall - y_all[te])))
        report.category_mean_mae = float(np.mean(np.abs(prior - y_all[te])))
    report.regressor_rows = int(rows.size)
    means, overall = _category_means(y_all[rows], groups[rows])
    base = np.array([means[g] for g in groups[rows]])
    model = Ridge(alpha=alpha).fit(X[rows], y_all[rows] - base)
    class_alpha = np.array([means.get(c, overall) for c in classes])
    return model, class_alpha, {
        "fitted": True, "estimator": "category mean + Ridge on the deviation", "alpha": alpha,
        "pair_id": pair_id, "rows": int(rows.size), "clip": [0.0, 1.0],
        "held_out_rows": int(te.size), "held_out_mae": report.mae,
        "baseline_mae": report.baseline_mae, "category_mean_mae": report.category_mean_mae,
        "class_alpha": dict(zip(classes, class_alpha.tolist())), "refit": "all rows"}


def fit_from_store(store, *, name: str = "default", pair_id: int | None = None,
                   since: datetime | float | None = None, until: datetime | float | None = None,
                   clusters: int | None = None, test_fraction: float = 0.2, seed: int = 0,
                   min_rows: int = 20, limit: int | None = None, save: bool = True,
                   **fit_kwargs: Any) -> tuple[Categorizer, FitReport]:
    """Read the logged features (``since`` inclusive, ``until`` exclusive; aware datetimes or
    Unix times) and fit; stored as the next version of ``name`` unless ``save=False``.

    A classifier learns from requests whose category the caller gave; when those carry fewer
    than two labels, or ``clusters`` is given, every request with features is clustered.
    Only features under the store's feature key count (``Store.feature_key``, never created
    here: FeatureKeyError, a ValueError, where the store has none)."""
    from autospec.store import queries

    key_id = FeatureKey(store.feature_key(create=False)).id

    def read(sources):
        with store.session() as s:
            return list(queries.feature_rows(s, pair_id=pair_id, sources=sources, since=since,
                                             until=until, limit=limit))

    rows = read(("given",))
    if clusters is None and len({r.category for r in rows}) >= 2:
        cat, report = fit_categorizer(rows, key_id=key_id, name=name, seed=seed,
                                      test_fraction=test_fraction, min_rows=min_rows,
                                      **fit_kwargs)
    else:
        rows = read(None)
        cat, report = fit_categorizer(rows, key_id=key_id, name=name, seed=seed,
                                      min_rows=min_rows,
                                      test_fraction=test_fraction,
                                      clusters=clusters or _default_clusters(len(rows)),
                                      **fit_kwargs)
    cat.meta["source"] = {
        "store": store.url, "pair_id": pair_id,
        "since": _iso(since) if isinstance(since, datetime) else since,
        "until": _iso(until) if isinstance(until, datetime) else until, "limit": limit,
    }
    if save:
        report.version = cat.save(store)
    return cat, report
