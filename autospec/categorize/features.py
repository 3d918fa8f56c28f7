"""Prompt features: keyed, hashed n-grams of a prompt's token ids, from which the categoriser
learns and predicts. Nothing in them can be turned back into text without the store's key.

A ``FeatureKey`` (32 secret bytes, kept outside the store's tables: ``autospec.store.keys``)
first gives every token id a secret 64-bit label, blake2b keyed by the secret; the features
are then unigrams and bigrams of the labels of the first ``HEAD_TOKENS`` and last
``TAIL_TOKENS`` tokens, mixed by SplitMix64's finaliser into ``N_BUCKETS`` buckets, encoded as

    byte 0            FEATURE_VERSION (2)
    bytes 1-4         the key's id, uint32 little-endian (a hash of the key, not the key)
    4·n bytes         sorted distinct bucket indices, uint32 little-endian
    2·n bytes         their counts, uint16 little-endian

so at most 6 bytes per distinct n-gram (≤ 12 KB for any prompt). Format 1, written before
features were keyed, mixed the token ids themselves: hashing every id of the vocabulary and
chaining the bigram buckets reads such a prompt back, so this autospec refuses it
(``FeaturesUnusable``, kind "unkeyed"). Without the key the labels are unknown random
numbers, and the buckets say nothing of which tokens or which order made them; with the key
(and the store) anyone can do what format 1 allowed everyone: docs/store.md says exactly
what a reader can and cannot learn.

Computing them is one pass over the head and tail tokens; a token id's label is computed once
per key and process (a table indexed by id). No torch import, no scikit-learn.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "FEATURE_VERSION", "UNKEYED_VERSION", "N_BUCKETS", "HEAD_TOKENS", "TAIL_TOKENS", "NGRAMS",
    "FeatureKey", "FeaturesUnusable", "prompt_features", "decode_features", "features_matrix",
]

FEATURE_VERSION = 2  # keyed (1: unkeyed, refused)
UNKEYED_VERSION = 1
N_BUCKETS = 1 << 18
HEAD_TOKENS = 256  # prompts longer than HEAD + TAIL tokens: n-grams of the first HEAD_TOKENS
TAIL_TOKENS = 768  # and of the last TAIL_TOKENS (none across the cut)
NGRAMS = (1, 2)
KEY_BYTES = 32
_HEADER = 5  # version byte + key id

_MASK = np.uint64(N_BUCKETS - 1)
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xC2B2AE3D27D4EB4F)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ORDER = (np.uint64(0), np.uint64(1), np.uint64(2))
_MAX_COUNT = np.iinfo(np.uint16).max
_TABLE_LIMIT = 1 << 21  # ids below it have their label cached (16 MB at most); others computed


class FeaturesUnusable(ValueError):
    """Prompt features this autospec cannot use: ``kind`` is "unkeyed" (format 1, readable
    back into tokens), "other key" (computed under another feature key) or "unreadable"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class FeatureKey:
    """The secret that keys a store's prompt features, and the labels it gives token ids.

    ``id`` (a 32-bit hash of the secret, stored in every blob) tells features of two keys
    apart; it reveals nothing of the secret. Thread-safe. The secret is not kept as an
    attribute and never printed."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) != KEY_BYTES:
            raise ValueError(f"a feature key is {KEY_BYTES} bytes")
        secret = bytes(secret)
        self.id = int.from_bytes(hashlib.blake2b(
            secret, digest_size=4, person=b"autospec-key-id").digest(), "little")
        self._label = hashlib.blake2b(key=secret, digest_size=8, person=b"autospec-token")
        self._lock = threading.Lock()
        self._table = np.zeros(0, dtype=np.uint64)
        self._known = np.zeros(0, dtype=bool)

    @classmethod
    def random(cls) -> FeatureKey:
        """A fresh key (for features that never leave this process)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @property
    def name(self) -> str:
        """The key's id as 8 hex digits (what messages and a categoriser's meta show)."""
        return f"{self.id:08x}"

    def __repr__(self) -> str:
        return f"FeatureKey(id={self.name})"

    def _compute(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty(ids.size, dtype="<u8")
        for i, t in enumerate(ids.tolist()):
            h = self._label.copy()
            h.update(int(t).to_bytes(8, "little", signed=True))
            out[i] = int.from_bytes(h.digest(), "little")
        return out.astype(np.uint64, copy=False)

    def labels(self, ids: np.ndarray) -> np.ndarray:
        """The secret 64-bit label of each token id (int64 array in, uint64 array out)."""
        ids = np.asarray(ids, dtype=np.int64)
        cached = (ids >= 0) & (ids < _TABLE_LIMIT)
        out = np.empty(ids.size, dtype=np.uint64)
        with self._lock:
            small = ids[cached]
            if small.size:
                top = int(small.max()) + 1
                if top > self._table.size:  # grow to a power of two: few regrowths
                    size = min(_TABLE_LIMIT, 1 << (top - 1).bit_length())
                    self._table = np.concatenate(
                        [self._table, np.zeros(size - self._table.size, np.uint64)])
                    self._known = np.concatenate(
                        [self._known, np.zeros(size - self._known.size, bool)])
                new = np.unique(small[~self._known[small]])
                if new.size:
                    self._table[new] = self._compute(new)
                    self._known[new] = True
                out[cached] = self._table[small]
        if not cached.all():
            out[~cached] = self._compute(ids[~cached])
        return out


# -- features ---------------------------------------------------------------------------------

def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, in place on a fresh uint64 array (wraps modulo 2**64)."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def _token_array(token_ids: Any) -> np.ndarray:
    if hasattr(token_ids, "detach"):  # a torch tensor (torch is not imported here)
        token_ids = token_ids.detach().cpu().numpy()
    ids = np.asarray(token_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"prompt_features needs one sequence of token ids, got shape {ids.shape}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    return ids.astype(np.int64, copy=False)


def _ngram_buckets(seg: np.ndarray) -> list[np.ndarray]:
    """The unigram and bigram hashes (unmasked) of one segment of 64-bit labels. Format 1
    applied this to the token ids themselves: that is what made it invertible."""
    out = [_mix(seg * _K1 + _ORDER[1])]
    if seg.size > 1:
        out.append(_mix(seg[:-1] * _K1 + seg[1:] * _K2 + _ORDER[2]))
    return out


def _segments(ids: np.ndarray) -> list[np.ndarray]:
    if ids.size > HEAD_TOKENS + TAIL_TOKENS:
        return [ids[:HEAD_TOKENS], ids[-TAIL_TOKENS:]]
    return [ids] if ids.size else []


def _encode(header: bytes, hashes: list[np.ndarray]) -> bytes:
    if not hashes:
        return header
    buckets = np.concatenate(hashes) & _MASK
    idx, counts = np.unique(buckets, return_counts=True)
    np.minimum(counts, _MAX_COUNT, out=counts)
    return header + idx.astype("<u4").tobytes() + counts.astype("<u2").tobytes()


def prompt_features(token_ids: Sequence[int] | np.ndarray, key: FeatureKey) -> bytes:
    """The prompt's keyed n-gram counts, encoded (see the module docstring). ``key``: the
    store's (``FeatureKey(store.feature_key())``); features of two keys never mix. Accepts a
    list, a 1-D array, or a [1, L] array or CPU/GPU tensor; pass the prompt without padding."""
    if not isinstance(key, FeatureKey):
        raise TypeError(f"prompt_features needs the store's FeatureKey, got "
                        f"{type(key).__name__}")
    header = bytes([FEATURE_VERSION]) + key.id.to_bytes(4, "little")
    segments = _segments(_token_array(token_ids))
    if not segments:
        return header
    labels = key.labels(np.concatenate(segments))  # one pass over head and tail
    cut = segments[0].size
    hashes = [h for seg in (labels[:cut], labels[cut:]) if seg.size
              for h in _ngram_buckets(seg)]
    return _encode(header, hashes)


def decode_features(blob: bytes, key_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bucket indices uint32, counts uint16) of an encoded blob. FeaturesUnusable (a
    ValueError) if the bytes are not features of this ``FEATURE_VERSION``, or (``key_id``
    given) were computed under another key."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise FeaturesUnusable("unreadable", f"prompt features must be bytes, got "
                                             f"{type(blob).__name__}")
    blob = bytes(blob)
    if not blob:
        raise FeaturesUnusable("unreadable", "empty prompt-feature blob (not even a format byte)")
    if blob[0] == UNKEYED_VERSION:
        raise FeaturesUnusable(
            "unkeyed", "unkeyed prompt features (format 1, logged before features were keyed): "
            "they can be read back into the prompt's tokens and are no longer used; "
            "`autospec categorize forget` clears them from the store")
    if blob[0] != FEATURE_VERSION:
        raise FeaturesUnusable(
            "unreadable", f"prompt features in format version {blob[0]}; this autospec reads "
            f"version {FEATURE_VERSION} (stored by another autospec release, or corrupt)")
    n, rest = divmod(len(blob) - _HEADER, 6)
    if n < 0 or rest:
        raise FeaturesUnusable("unreadable", f"corrupt prompt features: {len(blob)} bytes is "
                                             f"not {_HEADER} + 6·n")
    if key_id is not None:
        got = int.from_bytes(blob[1:_HEADER], "little")
        if got != key_id:
            raise FeaturesUnusable(
                "other key", f"prompt features computed under feature key {got:08x}, not "
                f"{key_id:08x} (another server's key file, or a key rotated since): refit the "
                "categoriser (`autospec categorize fit`) under the key serving uses, or serve "
                "with the key it was fitted under (docs/store.md)")
    idx = np.frombuffer(blob, dtype="<u4", count=n, offset=_HEADER)
    counts = np.frombuffer(blob, dtype="<u2", count=n, offset=_HEADER + 4 * n)
    if n and (idx[-1] >= N_BUCKETS or (n > 1 and not np.all(idx[1:] > idx[:-1]))
              or not np.all(counts)):
        raise FeaturesUnusable("unreadable", "corrupt prompt features: bucket indices not "
                                             f"strictly increasing below {N_BUCKETS}, or a zero "
                                             "count")
    return idx, counts


def _weights(counts: np.ndarray) -> np.ndarray:
    w = np.log1p(counts.astype(np.float64))
    norm = math.sqrt(float(w @ w))
    return w / norm if norm > 0 else w


def features_matrix(blobs: Sequence[bytes], key_id: int | None = None):
    """A scipy CSR matrix (rows × N_BUCKETS, float64): log(1 + count), rows l2-normalised.
    The transform ``Categorizer.predict`` applies to one blob. FeaturesUnusable as
    ``decode_features``."""
    import scipy.sparse as sp

    indptr = np.zeros(len(blobs) + 1, dtype=np.int64)
    cols, vals = [], []
    for i, blob in enumerate(blobs):
        idx, counts = decode_features(blob, key_id)
        cols.append(idx.astype(np.int32))
        vals.append(_weights(counts))
        indptr[i + 1] = indptr[i] + idx.size
    indices = np.concatenate(cols) if cols else np.zeros(0, np.int32)
    data = np.concatenate(vals) if vals else np.zeros(0, np.float64)
    return sp.csr_matrix((data, indices, indptr), shape=(len(blobs), N_BUCKETS))
