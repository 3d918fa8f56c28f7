"""Proposers: who drafts the block the target verifies. A proposer is one module: its class,
registered by name (``register``), is everything the engine, the policy's context, the
accounting, the store, replay, reports and export know of it. Nothing outside its module
names it: they iterate the registry.

Two kinds, by how a block is priced and served (``Proposer.kind``):

- ``"model"`` — a model drafting k tokens for every row in forwards over the whole batch,
  from a distribution q (the draft model). Its cache lags the target's: a block after others
  first catches up on what it has not seen (``gaps``). At most one per call.
- ``"lookup"`` — proposals that are a function of the context (prompt lookup, suffix
  decoding, a head over the target's hidden states): per row a draft or none (``matches``,
  ``sizes``), q one-hot, which keeps the rejection rule exact. Its blocks overlay the model's
  on the rows it serves.

Call order, per call of the engine (``CallView`` is what a proposer may read of the call):
the class is instantiated for the call's rows when its ``needs`` are met; then, every
iteration,

1. what the policy reads of it: ``matches()`` and ``sizes()`` (a lookup's match length and
   the tokens its draft holds, per row), ``gaps()`` (a model's catch-up, per row);
2. ``propose(it, rows, lengths)`` — only when ``decide`` assigned it rows: a ``Block`` for
   every row of the batch (rows it does not serve get length 0);
3. ``sync_parts()`` / ``read(values)`` — device values it wants back ride on the
   iteration's one host sync, in that order;
4. ``accept(it, steps)`` — after the sync, for every row, whether it drafted the row or not:
   what it emitted (``accounting.RowStep``), to update its state and to add what it learned —
   its match at the iteration's start (``step.matches``), the block it would have proposed
   compared with what was emitted where another drafted (``step.shadows``: llama.cpp's
   ``accept`` for every proposer), evidence of its own acceptance at a depth
   (``step.evidence``);

and ``select(keep, index)`` when rows leave, ``finish(row, stats)`` per row at the end (its
trace into ``stats.traces[name]``), ``release()`` always.

Offline, the class answers without a model: ``replay(record)`` (its per-request replay rule
over the trace its ``finish`` recorded: ``RowReplay``), ``trace_problem(trace, positions)``
(what the store refuses of a trace in its encoding) and ``export(engine, k)`` (the engine
setting that matches it, or None). A package outside autospec adds a proposer by calling
``register`` or through the ``autospec.proposers`` entry point group (a class, or a callable
returning one).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from autospec.traces import trace_length_problem

__all__ = ["Block", "Proposer", "RowReplay", "LookupReplay", "HostBlocks", "HostLookup",
           "EngineSetting", "register", "refusal",
           "unregister", "registered", "get", "model_proposer", "lookups", "by_code", "KINDS", "NEEDS",
           "ENTRY_POINTS"]

log = logging.getLogger(__name__)

KINDS = ("model", "lookup")
# what a proposer may need of a call: the draft model; the memory of the category's earlier
# outputs (``wrap(suffix=...)``); the target's last hidden state at the verified positions
NEEDS = ("draft_model", "memory", "hidden_states")
ENTRY_POINTS = "autospec.proposers"


@dataclass
class Block:
    """A proposer's block for every row of the batch."""

    tokens: torch.Tensor  # [B, k] proposed tokens (anything past a row's length)
    q: torch.Tensor | None  # [B, k, V] the distribution each was drawn from; None: one-hot
    lengths: torch.Tensor | None  # [B] each row's length (0: not served); None: k everywhere
    covers_all: bool = False  # it served every row (a model); lookups overlay their rows on it
    host_lengths: list[int] | None = None  # each row's length, as the host knows it


@dataclass
class EngineSetting:
    """What a proposer exports to a serving engine at lookahead k (``Proposer.export``):
    vLLM's ``--speculative-config`` and TensorRT-LLM's ``speculative_config`` (``config``; None:
    speculation off), SGLang's and llama.cpp's command-line ``flags``, and lines for the
    export's header (``notes``: what differs from autospec's proposer). ``traced``: whether
    the engine drafts by the rule autospec's traces of the proposer record — False where it
    drafts otherwise, so acceptance measured on those traces does not price it (``export
    --proposer auto`` then prefers the draft model, where the pair has one)."""

    config: dict[str, Any] | None = None
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    traced: bool = True


class RowReplay(Protocol):
    """One proposer over one logged request, replayed (``autospec.tune.replay``): what the
    live proposer would have shown and done at each generated position ``g``, read from the
    trace its ``finish`` recorded. A lookup answers ``now`` and ``block``; a model also
    keeps its catch-up state (``gap``, ``catch_up``, ``after``)."""

    gap: int  # a model: tokens its cache has not taken in (0 for a lookup)

    def now(self, g: int) -> tuple[int, int]:
        """(match length, tokens its draft holds) at position g ((0, 0): no draft)."""

    def block(self, g: int, k: int, *, stop: float | None, rng) -> tuple[int, int, bool]:
        """Its block of (at most) k from position g: (proposed, accepted, whether the trace
        ran out before the block's outcome was known)."""

    def shadow(self, g: int, emitted: int) -> tuple[int, int] | None:
        """Where another proposer drafted from g and ``emitted`` tokens came out: (its leading
        tokens equal to them, tokens compared), as the live ``accept`` reports; None: none."""

    def catch_up(self, g: int) -> list[tuple[int, float]]:
        """A model about to draft at g: the (depth, value) evidence its catch-up yields."""

    def after(self, g: int, who: str | None, proposed: int, accepted: int,
              width: int) -> None:
        """The iteration from g is over: ``who`` proposed ``proposed`` tokens of which
        ``accepted`` were, in a block ``width`` wide."""


class LookupReplay:
    """A lookup proposer over one logged request, from what its trace says at each position:
    ``read(g)`` → (match length, tokens of its draft that equal the output there, tokens its
    draft held), None where it had no draft. Its block of k from g holds at most its draft
    and accepts the agreeing ones; where another drafted, its shadow is the agreeing tokens
    of those emitted. It has no state of its own across positions."""

    gap = 0

    def __init__(self, read):
        self.read = read

    def now(self, g: int) -> tuple[int, int]:
        v = self.read(g)
        return (v[0], v[2]) if v else (0, 0)

    def block(self, g: int, k: int, *, stop=None, rng=None) -> tuple[int, int, bool]:
        v = self.read(g)
        if not v or not v[0]:
            return 0, 0, False
        k = min(k, v[2])
        return k, min(v[1], k), False

    def shadow(self, g: int, emitted: int) -> tuple[int, int] | None:
        v = self.read(g)
        if not v or not v[0]:
            return None
        return min(v[1], emitted), min(v[2], emitted)

    def catch_up(self, g: int) -> list[tuple[int, float]]:
        return []

    def after(self, g: int, who, proposed: int, accepted: int, width: int) -> None:
        pass


class Proposer:
    """The base of every proposer (see the module docstring for the call order). Class
    attributes describe it to everything that iterates the registry."""

    name: ClassVar[str]
    kind: ClassVar[str] = "lookup"
    needs: ClassVar[tuple[str, ...]] = ()
    # its byte in a request's per-iteration proposer schedule (unique; 255: none)
    code: ClassVar[int]
    # a lookup whose block the cost model first offers whole (its draft's own length rule)
    whole_draft: ClassVar[bool] = False
    # what its statistics are called in reports (default: the name)
    title: ClassVar[str] = ""

    def __init__(self, call):
        self.call = call

    # -- what the policy reads ----------------------------------------------------------
    def matches(self) -> list[int]:
        return [0] * len(self.call.rows)

    def sizes(self) -> list[int]:
        return [self.call.k_max] * len(self.call.rows)

    def gaps(self) -> list[int]:
        return [0] * len(self.call.rows)

    # -- one iteration -------------------------------------------------------------------
    def propose(self, it, rows: list[int], lengths: list[int]) -> Block:
        raise NotImplementedError

    def sync_parts(self) -> list[torch.Tensor]:
        return []

    def read(self, values: list[int]) -> None:
        pass

    def accept(self, it, steps) -> None:
        pass

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        pass

    def finish(self, row, stats) -> None:
        pass

    def release(self) -> None:
        pass

    # -- offline -------------------------------------------------------------------------
    @classmethod
    def replay(cls, record) -> RowReplay | None:
        """Its replay rule over one logged request (``record``: the store's ``TraceRow``, with
        ``traces`` by proposer name, ``trace_kind`` and ``prompt_tokens``); None where the
        request carries no trace of it (replay then offers it nothing)."""
        return None

    @classmethod
    def export(cls, engine: str, plan) -> EngineSetting | None:
        """The speculation setting of ``engine`` ("vllm", "sglang", "trtllm", "llamacpp")
        that matches it, for the export's ``plan`` (``autospec.fleet.export.ExportPlan``:
        its k per batch size, ``plan.k`` the one k of engines that take one, the models, the
        proposer's logged ``settings``), or None where the engine has nothing like it (the
        export then refuses with one line naming it)."""
        return None

    @classmethod
    def trace_problem(cls, trace: bytes, positions: int) -> str | None:
        """What is wrong with ``trace`` as its trace (``finish``'s, in its own encoding) of a
        request that generated ``positions`` tokens; None: nothing. The store refuses a record
        whose trace its proposer refuses (``autospec.store.write``), so replay never reads one
        its rule cannot. By default: a whole number of bytes per position (or none)."""
        return trace_length_problem(trace, positions)

    @classmethod
    def label(cls) -> str:
        return cls.title or cls.name

    @classmethod
    def describe(cls, settings: dict[str, Any] | None) -> str:
        """The export header's line on it, with the ``settings`` its requests logged."""
        return cls.label()


# -- the registry ---------------------------------------------------------------------------
_LOCK = threading.RLock()  # re-entered: the entry points register under it
_REGISTRY: dict[str, type[Proposer]] = {}
_loaded = False


def register(cls: type[Proposer], *, replace: bool = False) -> type[Proposer]:
    """Add ``cls`` to the proposers every call may use (usable as a class decorator).
    ValueError for a bad description, a name or code already taken (``replace``: take the
    name over), a second model proposer."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        raise ValueError(f"a proposer's name must be an ASCII identifier, got {name!r}")
    if name in ("hybrid", "plain", "off", "auto", "fixed", "table"):
        raise ValueError(f"{name!r} is a policy word: name the proposer otherwise")
    if cls.kind not in KINDS:
        raise ValueError(f"proposer {name!r}: kind must be one of {KINDS}, got {cls.kind!r}")
    unknown = set(cls.needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"proposer {name!r} needs {sorted(unknown)}: a call offers {NEEDS}")
    code = getattr(cls, "code", None)
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < 255:
        raise ValueError(f"proposer {name!r}: code must be an int in 0..254, got {code!r}")
    with _LOCK:
        _load_builtins()
        others = {n: c for n, c in _REGISTRY.items() if n != name or not replace}
        if name in others:
            raise ValueError(f"a proposer named {name!r} is registered already "
                             "(register(..., replace=True) takes its name over)")
        taken = {c.code: n for n, c in others.items()}
        if code in taken:
            raise ValueError(f"proposer {name!r}: code {code} is {taken[code]!r}'s")
        if cls.kind == "model" and any(c.kind == "model" for c in others.values()):
            raise ValueError(f"proposer {name!r}: a call has one model proposer, and "
                             f"{next(n for n, c in others.items() if c.kind == 'model')!r} "
                             "is registered")
        _REGISTRY[name] = cls
    return cls


def unregister(name: str) -> type[Proposer]:
    """Remove a proposer (KeyError if none has that name); returns its class."""
    with _LOCK:
        _load_builtins()
        return _REGISTRY.pop(name)


def registered() -> dict[str, type[Proposer]]:
    """Every registered proposer by name, in registration order: the built-ins, then those
    of the ``autospec.proposers`` entry points, then those registered in this process."""
    with _LOCK:
        _load_builtins()
        return dict(_REGISTRY)


def get(name: str) -> type[Proposer]:
    found = registered().get(name)
    if found is None:
        raise KeyError(f"no proposer named {name!r} is registered (registered: "
                       f"{', '.join(registered()) or 'none'})")
    return found


def model_proposer() -> str | None:
    """The registered model proposer's name, if any."""
    return next((n for n, c in registered().items() if c.kind == "model"), None)


def lookups() -> tuple[str, ...]:
    """The registered lookup proposers' names, in registration order."""
    return tuple(n for n, c in registered().items() if c.kind == "lookup")


def by_code() -> dict[int, str]:
    """Schedule byte → proposer name."""
    return {c.code: n for n, c in registered().items()}


def refusal(policy, *, has_draft: bool) -> str | None:
    """Why ``policy`` cannot serve a controller, or None: a proposer it names is not
    registered, or needs the draft model and the controller has none (a fixed k ≥ 1 of the
    model's, the hybrid, an ``"auto:SET"`` naming it)."""
    from autospec.policies.base import wanted

    known, names = registered(), wanted(policy)
    name = getattr(policy, "name", repr(policy))
    unknown = sorted(n for n in names if n is not None and n not in known)
    if unknown:
        return (f"policy {name!r} drafts with {', '.join(map(repr, unknown))}, which no "
                f"registered proposer is (registered: {', '.join(known)})")
    if not has_draft and any(n is None or "draft_model" in known[n].needs for n in names):
        return (f"policy {name!r} drafts with the draft model, and this controller has none: "
                "pass one (wrap(target, draft)), or a policy that drafts without it "
                "('ngram:K', 'suffix:K', 'auto', 'auto:ngram+suffix')")
    return None


def _load_builtins() -> None:
    """The built-in proposers, then the entry points' (once, under the lock)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from .draft_model import DraftModel
    from .prompt_lookup import PromptLookup
    from .suffix import SuffixLookup

    for cls in (DraftModel, PromptLookup, SuffixLookup):
        _REGISTRY[cls.name] = cls
    try:
        from importlib.metadata import entry_points

        found = entry_points(group=ENTRY_POINTS)
    except Exception as e:  # a broken installation must not stop serving
        log.warning("autospec: could not read the %s entry points: %s", ENTRY_POINTS, e)
        return
    for ep in found:
        try:
            cls = ep.load()
            register(cls if isinstance(cls, type) else cls())
        except Exception as e:
            log.warning("autospec: the proposer entry point %r could not be registered: %s",
                        ep.name, e)


# -- host lookups -----------------------------------------------------------------------------
class HostBlocks:
    """Blocks a lookup proposer builds in host memory, on their way to the device: one
    non-blocking copy per iteration it proposes in, from a staging buffer reused by every
    iteration (pinned on a GPU; the iteration's sync has completed the previous copy before
    the buffer is rewritten), never a blocking copy of a Python list. On the CPU the block
    is the buffer itself, valid for its iteration (nothing reads it after; the next block
    rewrites it). Row b's column 0 holds its length, then its tokens."""

    def __init__(self, call):
        stage = torch.zeros(len(call.rows), call.k_max + 1, dtype=torch.long)
        if call.device.type == "cuda":
            stage = stage.pin_memory()
        self.device = call.device
        self.stage, self.host = stage, stage.numpy()  # numpy: writes with no torch op

    def block(self, rows: int, k: int, blocks: dict[int, list[int]]) -> Block:
        """The block, k wide, of ``rows`` rows where row b proposes ``blocks[b]`` (at most k
        tokens; the other rows nothing)."""
        host = self.host
        if len(blocks) < rows:  # rows it does not serve: nothing
            host[:rows, : k + 1] = 0
        sizes = [0] * rows
        for b, toks in blocks.items():  # a served row in one write: length, tokens, zeros
            sizes[b] = n = len(toks)
            host[b, : k + 1] = [n, *toks, *(0,) * (k - n)]
        block = self.stage[:rows, : k + 1]
        if self.device.type != "cpu":
            block = block.to(self.device, non_blocking=True)
        return Block(tokens=block[:, 1:], q=None, lengths=block[:, 0], host_lengths=sizes)


class HostLookup(Proposer):
    """A lookup proposer in host memory: its blocks staged by ``HostBlocks``."""

    def __init__(self, call):
        super().__init__(call)
        self.staging = HostBlocks(call)
