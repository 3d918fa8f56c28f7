"""How the cost table measures: every number its rows settle, average and guard timings by
(``Measurement``), in one object beside the code that uses it. These are not the ``auto``
policy's parameters (``policies.params``): they say when a timing is believed, not what to do
with it, and none is tuned — searching a guard against timing noise on logged traffic would
fit the noise of the machine that logged it. docs/parameters.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

__all__ = ["Measurement", "MEASURE", "measurement_docs"]


def _m(default, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Measurement:
    """The cost table's numbers. Immutable: ``MEASURE.but(scatter=0.5)``."""

    # -- a cost point ---------------------------------------------------------------------------
    cost_settle: int = _m(3, "a cost point is the median of its first this many live samples, "
                             "then a moving average (a process's first forwards run slow)")
    cost_ema: float = _m(0.2, "weight of a new timing in a cost point's moving average")
    cost_noise: float = _m(0.25, "a live T_t's spread relative to T_t(1): growth within it reads "
                                 "as none when unmeasured points are priced optimistically")
    context_band: int = _m(512, "cached tokens past which a batch-1 request prices by its own "
                                "row: prompts of [0, c), [c, 2c), [2c, 4c)… tokens each time "
                                "their forwards apart (a longer context costs the draft's step "
                                "more than the target's)")
    catch_up_discount: float = _m(0.98, "the draft model's catch-up fit forgets at this rate "
                                        "per catch-up")
    catch_up_spread: float = _m(0.05, "catch-up sizes vary enough to fit a line (a + b·g) when "
                                      "their sd exceeds this share of their mean; else C ∝ g")
    # -- a busy machine (docs/policy.md, "When the machine is busy") ---------------------------
    shape_floor: float = _m(0.7, "the least T_t(n) / T_t(1), n > 1, trusted from live timings "
                                 "(a probe is exempt): a physical bound with a margin")
    level_move: float = _m(1.3, "the factor by which recent plain steps must differ from the "
                                "level the other points were measured at for the level to count "
                                "as moved")
    level_run: int = _m(3, "plain steps whose median is the recent level")
    scatter: float = _m(0.2, "recent timings of one n with interquartile range above this share "
                             "of their median say the machine is busy")
    scatter_window: int = _m(32, "iterations the scatter looks back over")
    recent: int = _m(8, "raw timings kept per n for the scatter")
    busy_hold: int = _m(32, "iterations the machine counts as busy after a level move or a "
                            "held-out shape")
    remeasure_every: int = _m(32, "at most one re-measure of the level per this many iterations "
                                  "when a shape is held out")
    marginal: float = _m(0.1, "while busy, a block's last token must be accepted with at least "
                              "this probability (k bounded by acceptance alone)")

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"measurement {name} must be {rule}, got {getattr(self, name)!r}")
        for name in ("cost_settle", "level_run", "scatter_window", "recent", "context_band"):
            if getattr(self, name) < 1:
                bad(name, "≥ 1")
        for name in ("cost_ema", "catch_up_discount", "shape_floor", "marginal"):
            if not 0 <= getattr(self, name) <= 1:
                bad(name, "in [0, 1]")
        if self.level_move <= 1:
            bad("level_move", "> 1")

    def but(self, **changes) -> Measurement:
        """A copy with ``changes``; an unknown name is refused with the known ones listed."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown measurement setting(s) {', '.join(unknown)}: they are "
                             f"{', '.join(sorted(known))}")
        return replace(self, **changes)


MEASURE = Measurement()


def measurement_docs() -> list[tuple[str, object, str]]:
    """(name, default, what it does) for every setting."""
    return [(f.name, f.default, f.metadata["doc"]) for f in fields(Measurement)]
