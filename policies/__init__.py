"""How the lookahead k is chosen (no torch import here: policies run anywhere)."""

from .bandit import ThompsonBandit
from .base import CallablePolicy, Context, Outcome, Policy, as_policy, auto_policy
from .costmodel import CostModelPolicy
from .fixed import FixedK
from .heuristic import Heuristic
from .live import LiveStats
from .tuned import TunedPolicy, build_policy

__all__ = ["CallablePolicy", "Context", "CostModelPolicy", "FixedK", "Heuristic", "LiveStats",
           "Outcome", "Policy", "ThompsonBandit", "TunedPolicy", "as_policy", "auto_policy",
           "build_policy"]
