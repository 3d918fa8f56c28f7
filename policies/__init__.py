"""How the lookahead k is chosen (no torch import here: policies run anywhere)."""

from .base import CallablePolicy, Context, Outcome, Policy, as_policy
from .fixed import FixedK
from .heuristic import Heuristic

__all__ = ["CallablePolicy", "Context", "Outcome", "Policy", "FixedK", "Heuristic", "as_policy"]
