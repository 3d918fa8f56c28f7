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
    "rejection_sample": "autospec.verify",
    "greedy_verify": "autospec.verify",
    "SamplingConfig": "autospec.sampling",
    "speculative_generate": "autospec.loop",
    "LoopStats": "autospec.loop",
    "load_pair": "autospec.models",
    "load_model": "autospec.models",
    "PairMismatchError": "autospec.checks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'autospec' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
