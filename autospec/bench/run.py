"""Benchmark: plain decoding, transformers' assisted generation and autospec on the same requests.

Every mode runs in one process on the same prompts, interleaved (for each repeat, for each
prompt, every mode, the order rotated so that no mode always runs first on a warm cache), so
that machine noise hits all modes alike. Per (category, mode) a row reports the median tokens/s,
the speedup against plain decoding of the same request and repeat (paired), acceptance, timings
and, for greedy decoding, whether every output equalled plain decoding's token for token.

With ``batch_sizes`` beyond (1,), the same modes also run on batches of prompts (see
``autospec.bench.batch``), and one row per (batch size, mode) reports the batch's tokens/s,
the paired speedup against plain batched decoding at that batch size, acceptance, the k
schedule, peak KV bytes and how many rows equalled plain's. Batch 1 runs as it always has.

The pure part (prompt files, mode lists, rows from run records, the table) needs no model; the
driver ``run_bench`` works with any (target, draft, tokenizer) triple.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from autospec.bench.batch import (
    DEFAULT_TABLE,
    batch_stats,
    make_batches,
    parse_int_list,
    run_batched,
    until_stop,
)
from autospec.bench.stats import (
    OVERALL,
    BatchRecord,
    RunRecord,
    aggregate,
    batch_records_of,
    first_divergence,
    foresight_of,
    head_to_head,
    summarize_batches,
)
from autospec.engine.proposers import get, lookups, refusal
from autospec.policies.base import K_LIMIT, parse_fixed

log = logging.getLogger(__name__)

__all__ = ["Prompt", "PromptFileError", "Mode", "RunRecord", "BenchResult", "load_prompts",
           "default_prompts_path", "parse_ks", "parse_modes", "aggregate",
           "encode_prompt", "run_bench", "DEFAULT_MODES", "DEFAULT_TABLE", "BatchRecord"]

DEFAULT_MODES = ("plain", "hf-assisted", "hf-assisted:k", "autospec:k")
_PROMPT_KEYS = {"category", "prompt", "chat"}


# -- prompts ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    category: str
    prompt: str
    chat: bool = False  # apply the tokenizer's chat template (with add_generation_prompt)


class PromptFileError(ValueError):
    """A prompts file that cannot be used; the message names the file and line."""


def default_prompts_path() -> Path:
    return Path(str(resources.files("autospec") / "prompts" / "default.jsonl"))


def load_prompts(path) -> list[Prompt]:
    """Read a JSONL file of ``{"category": str, "prompt": str, "chat": bool}`` objects."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read prompts file: {e}") from None
    prompts = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(obj.keys() - _PROMPT_KEYS)
        if unknown:
            raise PromptFileError(f"{where}: unknown keys {unknown} (allowed: category, prompt, chat)")
        for key in ("category", "prompt"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise PromptFileError(f"{where}: '{key}' must be a non-empty string")
        if obj["category"] == OVERALL:
            raise PromptFileError(f"{where}: category '{OVERALL}' is reserved for the totals row")
        chat = obj.get("chat", False)
        if not isinstance(chat, bool):
            raise PromptFileError(f"{where}: 'chat' must be true or false, got {chat!r}")
        prompts.append(Prompt(obj["category"], obj["prompt"], chat))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts in file")
    return prompts


def encode_prompt(tokenizer, prompt: Prompt):
    """Token ids [1, L] for a prompt, through the chat template when ``prompt.chat``."""
    text = prompt.prompt
    if prompt.chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("a prompt asks for the chat template but the tokenizer has none")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    # the template already holds any special tokens; a raw prompt gets the tokenizer's own
    return tokenizer(text, add_special_tokens=not prompt.chat, return_tensors="pt").input_ids


# -- modes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    kind: str  # "plain" | "hf-assisted" | "hf-lookup" | "autospec" | "policy" | a lookup's name
    k: int | None = None  # None: plain, or transformers' own default (schedule, or lookup k)
    policy: str | None = None  # kind "policy": a policy name for autospec.wrap(policy=...)

    @property
    def name(self) -> str:
        if self.kind == "policy":
            return f"policy:{self.policy}"
        return self.kind if self.k is None else f"{self.kind}:{self.k}"


def parse_policies(text: str) -> list[str]:
    """``auto,costmodel,bandit,heuristic,fixed:1..8,off`` → mode specs: fixed k and off are
    autospec:k modes (the same loop at a constant k), the rest adaptive policies."""
    from autospec.policies import as_policy

    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"fixed:(\d+)(?:\.\.(\d+))?", part)
        if m:
            lo, hi = int(m[1]), int(m[2] or m[1])
            if not 0 <= lo <= hi <= K_LIMIT:
                raise ValueError(f"{part!r}: k must be in 0..{K_LIMIT}, from low to high")
            out += [f"autospec:{k}" for k in range(lo, hi + 1)]
        elif part == "off":
            out.append("autospec:0")
        else:
            as_policy(part.removesuffix(SUFFIX_TAG))  # a clear error before any model loads
            out.append(f"policy:{part}")
    return out


def parse_ks(text: str, k_limit: int = K_LIMIT) -> list[int]:
    """``"1,2,4"`` → [1, 2, 4]; ValueError with a message fit for a user otherwise (an empty
    item, as in ``"1,,4"``, included)."""
    ks = parse_int_list(text, "integer", "1,2,4")
    bad = [k for k in ks if not 1 <= k <= k_limit]
    if bad:
        raise ValueError(f"every k must be in 1..{k_limit}, got {bad}")
    return sorted(set(ks))


# and NAME:k, a registered lookup proposer alone at a fixed k (``ngram``, ``suffix``, and any
# a package registers: ``autospec.engine.proposers.lookups``)
MODE_KINDS = ("plain", "hf-assisted", "hf-lookup", "autospec")
# policy:NAME+suffix: the policy in a controller that has the suffix proposer too (its memory
# starting empty each pass, as the suffix:k modes')
SUFFIX_TAG = "+suffix"
HF_LOOKUP_K = 10  # hf-lookup without :k: prompt_lookup_num_tokens as transformers' docs use it
NEEDS_DRAFT = ("hf-assisted", "autospec")  # modes that cannot run without a draft model


def parse_modes(specs: Iterable[str], ks: Sequence[int]) -> list[Mode]:
    """Mode names; ``KIND:k`` expands over ``ks``, ``KIND:N`` is one lookahead. plain is always
    included (first), since speedups and identity are measured against it."""
    modes = [Mode("plain")]
    for spec in specs:
        kind, _, k = spec.strip().partition(":")
        if kind == "policy":
            if not k or k == SUFFIX_TAG:
                raise ValueError(f"expected policy:NAME (or policy:NAME{SUFFIX_TAG}: the policy "
                                 "with the suffix proposer beside the others)")
            if Mode("policy", policy=k) not in modes:
                modes.append(Mode("policy", policy=k))
            continue
        if kind not in (*MODE_KINDS, *lookups()):
            raise ValueError(f"unknown mode {spec!r}: use plain, hf-assisted, hf-assisted:k, "
                             "hf-lookup, hf-lookup:k, autospec:k, policy:NAME, or a lookup "
                             f"proposer's NAME:k ({', '.join(lookups())}), a number in "
                             "place of k")
        if kind == "plain" or (kind in ("hf-assisted", "hf-lookup") and not k):
            new = [Mode(kind)]
        elif k == "k":
            new = [Mode(kind, x) for x in ks]
        elif kind != "hf-assisted" and kind != "hf-lookup" and k:  # the policy spec's rule: one parser
            try:  # autospec:0 = its loop, no draft (fixed:0); ngram:0 / suffix:0 are refused
                policy = parse_fixed(f"{'fixed' if kind == 'autospec' else kind}:{k}")
            except ValueError as e:
                raise ValueError(f"bad mode {spec!r}: {str(e).split(': ', 1)[-1]}") from None
            new = [Mode(kind, policy.k)]
        elif k.isascii() and k.isdigit() and int(k) >= 1:
            if int(k) > K_LIMIT:
                raise ValueError(f"bad mode {spec!r}: k must be at most {K_LIMIT}")
            new = [Mode(kind, int(k))]
        else:
            raise ValueError(f"bad mode {spec!r}: expected {kind}:k or {kind}:N")
        modes += [m for m in new if m not in modes]
    return modes


# -- result and table ---------------------------------------------------------------------
@dataclass
class BenchResult:
    meta: dict
    rows: list[dict]  # batch 1: per (category, mode)
    records: list[RunRecord]
    batches: list[dict] = field(default_factory=list)  # per (batch size, mode), every size
    batch_records: list[BatchRecord] = field(default_factory=list)  # batch > 1 calls
    # batch 1: each policy against the best fixed k and prompt lookup, request by request
    head_to_head: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        runs = [{k: v for k, v in asdict(r).items() if k not in ("tokens", "seen")}
                for r in self.records]
        batch_runs = [{k: v for k, v in asdict(r).items() if k != "rows"}
                      for r in self.batch_records]
        sizes = list(dict.fromkeys(r["batch"] for r in self.batches))
        batches = [{"batch": b, "rows": [r for r in self.batches if r["batch"] == b]}
                   for b in sizes]
        return _finite({"meta": self.meta, "rows": self.rows, "runs": runs,
                        "batches": batches, "batch_runs": batch_runs,
                        "head_to_head": self.head_to_head})

    def write_json(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


def _finite(obj):
    """NaN/inf → None, since JSON has no NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# -- the driver ---------------------------------------------------------------------------
def run_bench(target, draft, tokenizer, prompts: Sequence[Prompt], *,
              ks: Sequence[int] = (1, 2, 4, 6, 8), modes: Iterable[str] = DEFAULT_MODES,
              max_new_tokens: int = 64, repeats: int = 3, sample: bool = False,
              sampling: dict | None = None, seed: int = 0, warmup: bool = True,
              progress: bool = True, draft_tokenizer=None, store=None,
              batch_sizes: Sequence[int] = (1,), repeats_batch1: int | None = None
              ) -> BenchResult:
    """Run every mode on every prompt ``repeats`` times, interleaved; see the module docstring.

    sampling: extra generation settings for ``sample=True`` (temperature, top_p, top_k).
    The models are left as they were: the target is not wrapped, and the draft's assistant
    settings, which transformers reads from the draft's generation_config, are restored.
    store: a store URL for the ``policy:`` modes: they warm from its history, read tuned
    parameters from it (``policy:tuned``) and log their requests to it. Default: none.
    batch_sizes: batch 1 runs prompt by prompt (``rows``); each larger size runs on batches of
    prompts sorted by length (``batch_records``); ``batches`` summarises every size.
    repeats_batch1: repeats at batch 1 (default ``repeats``). Batch 1 pairs every prompt on its
    own, so one repeat of 16 prompts gives 16 paired ratios where a batch of 16 gives one: a run
    across batch sizes can spend its repeats where the samples are few.
    """
    import torch
    import transformers
    from tqdm.auto import tqdm

    import autospec

    single = repeats if repeats_batch1 is None else repeats_batch1
    if repeats < 1 or single < 1 or max_new_tokens < 1:
        raise ValueError("repeats and max_new_tokens must be >= 1")
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    mode_list = parse_modes(modes, ks)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    runner = _Runner(target, draft, tokenizer, draft_tokenizer=draft_tokenizer, modes=mode_list,
                    sample=sample, sampling=sampling or {}, store=store)
    usable = [m for m in mode_list if m not in runner.unsupported]
    unsupported = {(b, m.name): why for m, why in runner.unsupported.items() for b in sizes}
    batched = {b: make_batches(encoded, b, tokenizer) for b in sizes if b > 1}
    records: list[RunRecord] = []
    batch_records: list[BatchRecord] = []
    try:
        if warmup and 1 in sizes:  # first calls pay for allocation and lazy setup: untimed
            for mode in usable:
                runner.run(mode, encoded[0], min(8, max_new_tokens), seed, prompts[0].category)
        total = len(usable) * sum(repeats * len(batched[b]) if b > 1 else single * len(prompts)
                                  for b in sizes)
        with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
            for rep in range(single if 1 in sizes else 0):
                runner.new_pass()  # suffix modes start each pass with an empty memory
                for i, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
                    shift = (rep + i) % len(usable)
                    for mode in usable[shift:] + usable[:shift]:
                        bar.set_postfix_str(f"{prompt.category} {mode.name}", refresh=False)
                        out = runner.run(mode, ids, max_new_tokens, seed + 1000 * rep + i,
                                         prompt.category)
                        records.append(RunRecord(category=prompt.category, prompt_index=i,
                                                 repeat=rep, mode=mode.name, k=mode.k, **out))
                        bar.update()
            for b, groups in batched.items():
                done, refused = run_batched(
                    runner, groups, usable, batch_size=b,
                    categories=[p.category for p in prompts], repeats=repeats,
                    max_new_tokens=max_new_tokens, seed=seed, warmup=warmup, bar=bar)
                batch_records += done
                unsupported.update(refused)
    finally:
        runner.restore()
    if not sample:
        _explain_divergences(records, encoded, runner)
        _explain_batch_divergences(batch_records, encoded, runner)
        foresight_of(records)
    param = next(target.parameters())
    meta = {"target": _model_name(target), "draft": _model_name(draft),
            "device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "prompts": len(prompts), "repeats": repeats,
            "repeats_batch1": single,
            "max_new_tokens": max_new_tokens, "sample": sample, "sampling": sampling or {},
            "ks": list(ks), "modes": [m.name for m in mode_list], "torch": torch.__version__,
            "transformers": transformers.__version__, "autospec": autospec.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "batch": sizes,
            "batches": {str(b): len(groups) for b, groups in batched.items()}}
    rows = aggregate(records, greedy=not sample)
    for row in rows:
        row["batch"] = 1
    summary = summarize_batches([*batch_records_of(records), *batch_records], greedy=not sample,
                                unsupported=unsupported, modes=[m.name for m in mode_list])
    return BenchResult(meta=meta, rows=rows, records=records, batches=summary,
                       batch_records=batch_records,
                       head_to_head=head_to_head(records, rows, batch_records=batch_records,
                                                 batches=summary))


_ASSIST_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule",
                  "assistant_confidence_threshold")


class _Runner:
    """Runs and times one request in one mode, the same way for every mode."""

    def __init__(self, target, draft, tokenizer, *, draft_tokenizer, modes, sample, sampling,
                 store=None):
        from autospec.controller import Controller
        from autospec.policies import as_policy

        ks = [m.k for m in modes if m.kind == "autospec"]
        # not wrap(): the target's generate stays transformers' own for the other modes
        opts = dict(tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, k_max=max([16, *ks]),
                    store=False)
        self.ctrl = Controller(target, draft, **opts)
        # one controller per adaptive policy, so each learns from its own runs only
        policy_opts = dict(opts, store=store if store is not None else False)
        self.policy_ctrls, self.unsupported = {}, {}  # unsupported: mode → why
        if draft is None:
            for m in modes:
                if m.kind in NEEDS_DRAFT:
                    self.unsupported[m] = "no draft model (--draft none)"
        for m in (m for m in modes if m.kind == "policy"):
            name, tagged = m.policy.removesuffix(SUFFIX_TAG), m.policy.endswith(SUFFIX_TAG)
            why = refusal(as_policy(name), has_draft=draft is not None)
            if why is not None:
                self.unsupported[m] = f"no draft model (--draft none): {why.split(', and')[0]}"
                continue
            try:
                self.policy_ctrls[m] = Controller(target, draft, policy=name,
                                                  suffix=True if tagged else None,
                                                  **policy_opts)
            except ValueError as e:
                if not m.policy.startswith("table"):
                    raise
                # a policy this autospec does not know yet: report it, run the others
                self.unsupported[m] = str(e)
        # modes of a lookup that needs the category's memory (suffix decoding): one controller
        # each, whose memory holds the outputs of its own earlier requests of this pass only
        # (``new_pass``): requests in order, earlier ones help later
        lookup_names = lookups()
        self.memory_ctrls = {m: Controller(target, draft, suffix=True, **opts) for m in modes
                             if m.kind in lookup_names and "memory" in get(m.kind).needs}
        self._category_lists = True  # until the controller refuses a list of categories
        # transformers' generate even if the caller wrapped the target (an instance attribute)
        self.generate = type(target).generate.__get__(target)
        self.target, self.draft, self.sample = target, draft, sample
        self.device = next(target.parameters()).device
        gc = target.generation_config
        eos = gc.eos_token_id
        pad = gc.pad_token_id if gc.pad_token_id is not None else (
            eos[0] if isinstance(eos, (list, tuple)) else eos)
        # the same stopping and padding for every mode; EOS stays on (new tokens are reported)
        self.kwargs = {"do_sample": sample, "eos_token_id": eos, "pad_token_id": pad, **sampling}
        # transformers reads assisted-generation settings from the *draft's* generation_config
        # (kwargs to generate do not reach them), and its heuristic schedule writes its state
        # back there. Each hf mode keeps its own copy, swapped in around its calls, so modes
        # cannot leak into each other and the default mode evolves as it would for a user.
        dgc = draft.generation_config if draft is not None else None
        self._saved = {f: getattr(dgc, f, None) for f in _ASSIST_FIELDS}
        fixed = {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
        self._assist = {m: dict(self._saved) if m.k is None else {"num_assistant_tokens": m.k, **fixed}
                        for m in modes if m.kind == "hf-assisted"}

    def new_pass(self) -> None:
        """A new pass over the prompts: the modes with a memory forget what earlier passes
        emitted (a repeat of a prompt would otherwise find its own output)."""
        from autospec.suffix import SuffixMemory

        for ctrl in (*self.memory_ctrls.values(), *self.policy_ctrls.values()):
            if ctrl.suffix_memory is not None:
                ctrl.suffix_memory = SuffixMemory(ctrl.suffix_memory.settings)

    def run(self, mode: Mode, ids, max_new_tokens: int, seed: int,
            category: str | list[str] = "default", attention_mask=None) -> dict:
        """One request: ids [1, L], or a left-padded batch [B, L] (B >= 1) with its
        attention_mask and one category per row. Batches come back with ``rows`` (each row's
        new tokens up to its stop) instead of ``tokens``."""
        import torch

        ids = ids.to(self.device)
        as_batch, batched = attention_mask is not None, ids.shape[0] > 1
        if not batched and isinstance(category, (list, tuple)):
            category = category[0]
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(self.device)
        kw = dict(self.kwargs, input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens)
        counts, hooks = [0, 0], []
        ctrl = self.policy_ctrls.get(mode) or self.memory_ctrls.get(mode) or self.ctrl
        fallbacks = dict(ctrl.fallbacks)
        if mode.kind in ("autospec", "policy"):
            gen = torch.Generator(self.device).manual_seed(seed) if self.sample else None

            def call():
                # a controller without batch support refuses a list of categories; it then
                # serves the batch with transformers' generate, which needs none
                cat = category if self._category_lists or not batched else None
                return ctrl.generate(k=mode.k, generator=gen, category=cat, **kw)
        elif mode.kind == "hf-assisted":
            self._set_assist(self._assist[mode])
            # forward counts give acceptance without touching transformers' internals: each
            # target forward verifies one block, each draft forward proposes one token
            hooks = [m.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
                     for i, m in enumerate((self.target, self.draft))]
            call = lambda: self.generate(assistant_model=self.draft, **kw)  # noqa: E731
        elif mode.kind == "hf-lookup":  # transformers' prompt lookup: target forwards counted
            hooks = [self.target.register_forward_hook(
                lambda *_: counts.__setitem__(0, counts[0] + 1))]
            look = HF_LOOKUP_K if mode.k is None else mode.k
            call = lambda: self.generate(prompt_lookup_num_tokens=look, **kw)  # noqa: E731
        elif mode.kind in lookups():  # one of autospec's lookup proposers at a fixed k
            from autospec.policies import Choice

            def call():
                cat = category if self._category_lists or not batched else None
                return ctrl.generate(k=Choice(mode.k, mode.kind), category=cat, **kw)
        else:
            call = lambda: self.generate(**kw)  # noqa: E731
        try:
            try:
                out, wall = self._timed(call, seed)
            except (TypeError, ValueError) as e:
                if not (batched and self._category_lists and "category" in str(e)
                        and mode.kind in ("autospec", "policy")):
                    raise
                log.info("bench: the controller takes no list of categories (%s): batches go "
                         "without one", e)
                self._category_lists = False
                out, wall = self._timed(call, seed)
        finally:
            for h in hooks:
                h.remove()
            if mode.kind == "hf-assisted":
                self._assist[mode] = {f: getattr(self.draft.generation_config, f, None)
                                      for f in _ASSIST_FIELDS}
        if as_batch:
            eos = self.kwargs["eos_token_id"]
            eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
            rows = [until_stop(row, eos) for row in out[:, ids.shape[1]:].tolist()]
            rec = {"new_tokens": sum(map(len, rows)), "wall_s": wall, "rows": rows}
            if mode.kind in ("autospec", "policy", *lookups()):
                rec.update(batch_stats(ctrl.last_stats))
                if ctrl.last_stats is None:
                    rec["fallback"] = next((why for why, n in ctrl.fallbacks.items()
                                            if n > fallbacks.get(why, 0)), "fallback")
            return rec
        tokens = out[0, ids.shape[1]:].tolist()
        rec = {"new_tokens": len(tokens), "wall_s": wall, "tokens": tokens}
        if mode.kind == "hf-assisted" and self.target is not self.draft:
            # every iteration keeps its accepted tokens plus one: accepted = new - iterations
            rec.update(target_forwards=counts[0], drafted=counts[1],
                       accepted=max(0, min(counts[1], len(tokens) - counts[0])))
        elif mode.kind == "hf-lookup":  # proposals are not forwards: tokens per forward only
            rec.update(target_forwards=counts[0])
        elif mode.kind in lookups():
            s = ctrl.last_stats
            if s is not None:  # the lookup proposer's own counters in the acceptance columns
                c = s.proposer(mode.kind)
                rec.update(target_forwards=s.iterations, drafts=c.blocks,
                           drafted=c.proposed, accepted=c.accepted,
                           t_target_1=s.target_time(1),
                           t_draft=c.seconds / c.proposed if c.proposed else None,
                           t_target_k1=s.target_time(mode.k + 1),
                           k_schedule=list(s.k_schedule),
                           accepted_per_position=list(c.accepted_per_position),
                           drafted_per_position=list(c.proposed_per_position))
        elif mode.kind in ("autospec", "policy"):
            s = ctrl.last_stats
            if s is None:
                log.warning("autospec served a request through transformers' generate "
                            "(fallbacks: %s)", ctrl.fallbacks)
            else:
                rec.update(target_forwards=s.iterations, drafts=s.drafts, drafted=s.drafted,
                           accepted=s.accepted, peak_kv_bytes=getattr(s, "peak_kv_bytes", 0) or None,
                           t_target_1=s.target_time(1), t_draft=s.draft_time,
                           t_target_k1=s.target_time(mode.k + 1) if mode.k else None,
                           k_schedule=list(s.k_schedule),
                           accepted_per_position=list(s.accepted_per_position),
                           drafted_per_position=list(s.drafted_per_position),
                           lookups={n: [c.proposed, c.accepted] for n, c in s.counts.items()
                                    if n != s.model and c.proposed} or None)
        if mode.kind in ("autospec", "policy", *lookups()) and not self.sample:
            rec["seen"] = _seen(ctrl.last_stats)
        return rec

    def _timed(self, call, seed: int):
        """(output, seconds) of one call, sampling seeded in a fork of torch's RNG."""
        import torch

        cuda = self.device.type == "cuda"
        # generate samples from torch's global RNG: seed it in a fork, leaving the caller's
        with torch.random.fork_rng(devices=[self.device] if cuda else [], enabled=self.sample):
            if self.sample:
                torch.manual_seed(seed)
            t0 = time.perf_counter()
            out = call()
            if cuda:
                torch.cuda.synchronize(self.device)
            return out, time.perf_counter() - t0

    def _set_assist(self, values: dict) -> None:
        if self.draft is None:  # no draft model: no assisted-generation settings to keep
            return
        for name, value in values.items():
            setattr(self.draft.generation_config, name, value)

    def restore(self) -> None:
        self._set_assist(self._saved)
        for ctrl in self.policy_ctrls.values():  # flush what the policy modes logged
            ctrl.close()

    def top2_margin(self, ids, prefix: list[int]) -> float:
        return top2_margin(self.target, ids, prefix)


def top2_margin(target, ids, prefix: list[int]) -> float:
    """The target's raw logit gap between its top two tokens after prompt ``ids`` [1, L] +
    ``prefix``: near 0, greedy decoding sits on a numerical near-tie."""
    import torch

    device = next(target.parameters()).device
    with torch.inference_mode():
        x = torch.cat([ids.to(device), torch.tensor([list(prefix)], dtype=ids.dtype,
                                                     device=device)], dim=1)
        top = target(input_ids=x).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


# a top-2 logit margin below this is a near-tie that low-precision rounding can flip (bf16
# keeps 8 significant bits: logits near 20 are resolved to about 0.06-0.125; summing the same
# products in another order moves them by a few of those steps)
NEAR_TIE = 0.5


def explain_divergence(target, ids, plain: list[int], other: list[int], dtype) -> str | None:
    """Why greedy autospec output differs from plain decoding's, in words: where they part,
    the target's top-2 margin there, and whether that is a low-precision near-tie (fp32 is
    token-exact) or something to report. None when the outputs are equal."""
    import torch

    from autospec.bench.stats import first_divergence

    pos = first_divergence(plain, other)
    if pos is None:
        return None
    if pos >= min(len(plain), len(other)):
        return (f"one stops earlier, at new token {pos} (plain {len(plain)} tokens, autospec "
                f"{len(other)})")
    margin = top2_margin(target, ids, plain[:pos])
    where = (f"they part at new token {pos} (plain token {plain[pos]}, autospec "
             f"{other[pos]}), where the target's top two logits are {margin:.3f} apart")
    if dtype in (torch.bfloat16, torch.float16) and margin < NEAR_TIE:
        name = "bf16" if dtype == torch.bfloat16 else "fp16"
        return (f"{where}: a {name} near-tie — scoring several tokens per forward sums the "
                f"same products in another order, and {name} rounds them differently; in fp32 "
                "(--dtype fp32) greedy output is token-exact")
    return (f"{where}: not a rounding near-tie — please report it with this prompt "
            "(greedy output should equal plain decoding's)")


def _seen(stats) -> dict | None:
    """What perfect foresight is priced from (``stats.foresight_of``): the request's traces
    (a trace the store's writer would compute, computed now: after the timed call), its
    forwards and prefill; None for a request generate served."""
    if stats is None:
        return None
    traces = {n: t() if callable(t) else t for n, t in stats.traces.items()}
    return {"traces": {n: bytes(t) for n, t in traces.items() if t},
            "model": stats.model, "proposers": list(stats.proposers or stats.counts),
            "prefill_s": stats.prefill_s,
            "target_s_by_n": {n: list(v) for n, v in stats.target_s_by_n.items()},
            "draft_s": stats.draft_s, "draft_forwards": stats.draft_forwards,
            "lookup_blocks": sum(c.blocks for n, c in stats.counts.items() if n != stats.model)}


def _explain_divergences(records: list[RunRecord], encoded, runner) -> None:
    """For each greedy output that differs from plain's, find where, and how close the target's
    top two logits were there: a margin near 0 is a numerical near-tie, not a bug."""
    plain = {(r.prompt_index, r.repeat): r for r in records if r.mode == "plain"}
    memo: dict[tuple, float] = {}
    for r in records:
        base = plain[(r.prompt_index, r.repeat)]
        if r is base:
            continue
        pos, margin = _parting_margin(runner, encoded, r.prompt_index, base.tokens, r.tokens,
                                      memo)
        if pos is None:
            continue
        r.divergence = {
            "prompt_index": r.prompt_index, "repeat": r.repeat, "position": pos,
            "plain_token": base.tokens[pos] if pos < len(base.tokens) else None,
            "token": r.tokens[pos] if pos < len(r.tokens) else None, "margin": margin,
        }


def _parting_margin(runner, encoded, prompt: int, ref, other, memo: dict
                    ) -> tuple[int | None, float | None]:
    """(where ``other`` first parts from plain's ``ref``, None if nowhere; the target's top-2
    logit margin there, None where one stops earlier): one target forward over the prompt +
    ``ref`` up to there, once per (prompt, prefix) in ``memo``."""
    pos = first_divergence(ref, other)
    if pos is None or pos >= min(len(ref), len(other)):
        return pos, None
    key = (prompt, tuple(ref[:pos]))
    if key not in memo:
        memo[key] = runner.top2_margin(encoded[prompt], ref[:pos])
    return pos, memo[key]


def _explain_batch_divergences(records: list[BatchRecord], encoded, runner) -> None:
    """For each greedy row of a batch that differs from plain batched decoding's row (same
    batch, same repeat), the target's top-2 logit margin where they first part (one forward
    of the prompt alone + plain's row up to there): near 0, a rounding near-tie."""
    plain = {(r.batch, r.group, r.repeat): r for r in records if r.mode == "plain"}
    memo: dict[tuple, float] = {}
    for r in records:
        base = plain.get((r.batch, r.group, r.repeat))
        if base is None or r is base:
            continue
        for i, (row, ref) in enumerate(zip(r.rows, base.rows, strict=False)):
            pos, margin = _parting_margin(runner, encoded, r.prompt_indices[i], ref, row, memo)
            if pos is not None:
                r.margins[i] = margin  # None: one stops earlier, no token to compare there


def _model_name(model) -> str:
    if model is None:
        from autospec.telemetry import NO_DRAFT

        return NO_DRAFT
    return str(getattr(model, "name_or_path", "") or type(model).__name__)
