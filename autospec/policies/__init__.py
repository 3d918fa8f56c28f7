"""How the lookahead k is chosen (no torch import here: policies run anywhere)."""

from .bandit import ThompsonBandit
from .base import (
    HYBRID,
    CallablePolicy,
    Choice,
    Context,
    Outcome,
    Policy,
    as_policy,
    auto_policy,
    batch_bucket,
    proposer_of,
)
from .costmodel import CostModelPolicy
from .fixed import FixedK
from .heuristic import Heuristic
from .live import LiveStats
from .table import TablePolicy
from .tuned import TunedPolicy, build_policy

__all__ = ["CallablePolicy", "Choice", "HYBRID", "proposer_of", "Context", "CostModelPolicy", "FixedK", "Heuristic",
           "LiveStats", "Outcome", "Policy", "TablePolicy", "ThompsonBandit", "TunedPolicy",
           "as_policy", "auto_policy", "batch_bucket", "build_policy"]
