"""autospec.store: per-request telemetry and per-category statistics in a SQL database.

    store = open_store("sqlite:///autospec.db")     # or None (cache dir), a path, any URL
    writer = store.writer()                          # background batches, never blocks
    writer.submit(record)                            # a RequestRecord, from generate()
    with store.session() as s:
        for summary in queries.category_summaries(s):
            ...
    store.close()                                    # flushes writers

No torch here, and exports are lazy: ``from autospec.store.record import …`` (the runtime,
the simulator) does not import SQLAlchemy; ``autospec stats`` and the policies stay light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PairInfo": "record",
    "RequestRecord": "record",
    "TRACE_GREEDY": "record",
    "TRACE_SAMPLED": "record",
    "UNOBSERVED": "record",
    "NGRAM_NONE": "record",
    "Store": "database",
    "StoreError": "database",
    "StoreDamaged": "database",
    "FeatureKeyError": "keys",
    "StoreUnusable": "database",
    "StoreTooNew": "database",
    "StoreReadOnly": "database",
    "default_url": "database",
    "open_store": "database",
    "StoreWriter": "writer",
    "WriterStats": "writer",
    "add_probe": "write",
    "add_tuned_params": "write",
    "add_categorizer": "write",
    "trace_acceptance": "record",
    "CATEGORY_SOURCES": "record",
    "check_category": "record",
    "get_or_create_pair": "write",
    "write_records": "write",
}

__all__ = sorted([*_EXPORTS, "queries"])


def __getattr__(name: str):
    if name == "queries":
        return importlib.import_module(f"{__name__}.queries")
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
