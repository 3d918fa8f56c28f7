"""Count the torch operations a piece of code runs (a behavioural check of the work it does,
through torch's own dispatcher: nothing is replaced)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """``counts[name]``: calls of aten op ``name`` (e.g. "softmax", "div"; a leading underscore
    dropped, so that "softmax" counts "_softmax" too, whichever level dispatches) whose
    output's last dimension is ``width`` (every call when ``width`` is None); ``every``: all
    calls, whatever their width."""

    def __init__(self, width: int | None = None):
        super().__init__()
        self.width = width
        self.counts: Counter[str] = Counter()
        self.every: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.every[func.overloadpacket.__name__.lstrip("_")] += 1
        if self.width is None or (isinstance(out, torch.Tensor) and out.dim()
                                  and out.shape[-1] == self.width):
            self.counts[func.overloadpacket.__name__.lstrip("_")] += 1
        return out
