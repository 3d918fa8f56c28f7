"""autospec: exact speculative decoding for transformers' ``generate``.

Exports are lazy so that ``import autospec.policies`` (or the store) does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "wrap": "autospec.controller",
    "unwrap": "autospec.controller",
    "Controller": "autospec.controller",
    "rejection_sample": "autospec.engine.verify",
    "greedy_verify": "autospec.engine.verify",
    "SamplingConfig": "autospec.engine.sampling",
    "speculative_generate": "autospec.engine.generate",
    "LoopStats": "autospec.engine.stats",
    "load_pair": "autospec.pairs",
    "load_model": "autospec.pairs",
    "PairMismatchError": "autospec.engine.checks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'autospec' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
