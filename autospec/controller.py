"""``autospec.wrap(model, draft)``: make ``model.generate`` speculative, exactly.

The controller accepts what transformers' ``generate`` accepts, plus ``category=``,
``tenant=``, ``k=`` and ``generator=``. A request it can serve exactly runs the speculative
loop (logits processors that depend on the prefix alone included); anything else (beam search,
contrastive search, a processor that keeps state across calls, …) goes unchanged to the model's
own ``generate``, and the reason is logged once per kind of request.

(The module is named ``controller`` so that it cannot shadow the ``autospec.wrap`` function.)
"""

from __future__ import annotations

import copy
import logging
import numbers
import os
import threading
import types
import weakref
from dataclasses import replace

import torch

from autospec.costs.table import CostTable
from autospec.engine.plan import Plan, plan_request
from autospec.engine.proposers import refusal
from autospec.engine.runners import path_name
from autospec.engine.stats import LoopStats, merge_stats
from autospec.policies.base import Policy, as_policy, params_of, proposer_of, wanted
from autospec.policies.fixed import FixedK
from autospec.policies.live import LiveStats
from autospec.policies.params import CONSTANTS
from autospec.suffix_memory import check_tenant
from autospec.traces import capped

log = logging.getLogger(__name__)

__all__ = ["Controller", "wrap", "unwrap", "K_LIMIT"]

from autospec.policies.base import K_LIMIT  # noqa: E402, I001 -- the one limit on k

BATCHED = path_name(False)  # the execution path a batched call runs on

class Controller:
    """Speculative ``generate`` for one target/draft pair."""

    def __init__(self, model, draft=None, *, policy="auto", k_max: int = 16, tokenizer=None,
                 draft_tokenizer=None, match_draft: bool = True, category: str | None = None,
                 store=None, log_text: bool = False, names: tuple[str, str] | None = None,
                 categorize=None, log_features: bool = True, static_cache: bool = False,
                 cuda_graphs="auto", metrics=False, ngram=None, suffix=None,
                 tenant: str | None = None):
        from autospec.engine.checks import check_pair
        from autospec.engine.runners import resolve_graphs

        k_max = _check_k_max(k_max)
        check_pair(model, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                   match_draft=match_draft)
        self.model = model
        self.draft = draft  # None: the n-gram proposer drafts alone
        from autospec.engine.checks import attention_layout

        self.layouts = [attention_layout(model)] + (
            [] if draft is None else [attention_layout(draft, "draft")])
        # by proposer name, what wrap was given for it (prompt lookup's index factory)
        self.options = {"ngram": _ngram_factory(ngram)}
        # the category memory of earlier outputs (suffix decoding's; this process only)
        self.suffix_memory = None
        if suffix:
            from autospec.suffix import SuffixMemory, SuffixSettings

            self.suffix_memory = SuffixMemory(SuffixSettings.of(suffix))
        # forwards: transformers' DynamicCache (default), or a static KV cache replayed from
        # CUDA graphs where there is a GPU (autospec.engine.runners); checked here, used per request
        if cuda_graphs is True and not static_cache:
            raise ValueError("cuda_graphs=True replays forwards on a static cache: pass "
                             "static_cache=True as well")
        graphs = resolve_graphs(cuda_graphs, next(model.parameters()).device)
        self.static_cache, self.cuda_graphs = bool(static_cache), cuda_graphs
        # the path batch-1 requests run on: the warm start reads that path's costs only
        self.path = path_name(self.static_cache, graphs if self.static_cache else None)
        self.tokenizer = tokenizer
        self.k_max = k_max
        # a category named here counts as given; None: the categoriser's, else "default"
        self.category = None if category is None else _check_category(category)
        # whose earlier outputs the suffix memory drafts from (None: every untenanted request's)
        self.tenant = None if tenant is None else check_tenant(tenant)
        self.policy: Policy = as_policy(policy)
        why = refusal(self.policy, has_draft=draft is not None)
        if why is not None:
            raise ValueError(why)
        if suffix is None and _needs_memory(self.policy):
            from autospec.suffix import SuffixMemory

            self.suffix_memory = SuffixMemory()  # "suffix:K" or "auto:…+suffix" asks for it
        self._owns_policy = isinstance(policy, str)
        self._local = threading.local()  # last_stats is per thread: concurrent calls don't mix
        self.fallbacks: dict[str, int] = {}  # reason → how many requests took it
        self._original_generate = type(model).generate.__get__(model)
        self._lock = threading.Lock()
        self.target_context = _context_length(model)
        self.draft_context = None if draft is None else _context_length(draft)
        self.log_text = log_text
        self.live: dict[str, LiveStats] = {}  # per category: acceptance and rate, live
        # the pair's costs per (execution path, batch size), shared by every category; the
        # paths whose batch-1 row was warmed from the store, and whether the grid was
        self.costs = CostTable()
        self._warmed: set[str] = set()
        self._grid_warmed = False
        self.store = self.writer = self.telemetry = self._release_store = None
        self.store_failures = 0  # the store's failures: at wrap, and queueing records
        self.store_unusable: str | None = None  # why serving runs without telemetry
        self.log_features = log_features
        self.categorizer = None
        if store is not False:
            self._open_store(store, names)
        self._setup_categorizer(categorize)
        self._setup_features(categorize)
        self._setup_metrics(metrics, names)
        if hasattr(self.policy, "attach"):
            if self.store is None:
                log.warning("autospec: policy %r follows tuned parameters in the store, but "
                            "the store is off: it serves the untuned default",
                            getattr(self.policy, "name", self.policy))
            else:
                from autospec.store.queries import tuned_fetcher

                self.policy.attach(tuned_fetcher(self.store, self.telemetry.pair))

    def _setup_categorizer(self, categorize) -> None:
        """categorize: None — the store's "default" categoriser if one was fitted; a name —
        that one (an error if missing); a Categorizer; False — never categorise."""
        self._forecast = False  # acceptance forecasts hold only for the pair they were fit on
        if categorize is False:
            return
        if categorize is not None and not isinstance(categorize, str):
            if not callable(getattr(categorize, "predict", None)):
                raise TypeError(f"categorize= takes None, False, a categoriser's name or a "
                                f"Categorizer, got {type(categorize).__name__}")
            self.categorizer = categorize
            self._announce_categorizer()
            return
        if self.store is None:
            if categorize is not None and self.store_unusable is None:
                raise ValueError(f"categorize={categorize!r} loads a categoriser from the "
                                 "store, but the store is off (store=False)")
            if categorize is not None:
                log.warning("autospec: the categoriser %r is not loaded (the store is "
                            "unusable): requests without a category get 'default'", categorize)
            return
        from autospec.categorize.categorizer import Categorizer

        name = categorize or "default"
        try:
            self.categorizer = Categorizer.load(self.store, name)
        except Exception as e:  # a broken row must not stop serving: no categories, logged
            if categorize is not None:
                raise
            log.warning("autospec: could not load the categoriser %r (requests without a "
                        "category get 'default'): %s", name, e)
        if self.categorizer is None and categorize is not None:
            raise ValueError(f"no categoriser named {name!r} in {self.store.url}: fit one "
                             "with `autospec categorize fit`")
        if self.categorizer is not None:
            self._announce_categorizer()

    def _announce_categorizer(self) -> None:
        """Log the categoriser, and use its acceptance forecasts only when it was fitted on
        this pair (read from the store; without a store, never)."""
        log.info("autospec: categorising uncategorised requests with %s v%s",
                 getattr(self.categorizer, "name", "?"), getattr(self.categorizer, "version", "?"))
        fitted_on = getattr(self.categorizer, "regressor_pair_id", None)
        if fitted_on is not None and self.store is not None:
            from autospec.store import queries

            with self.store.session() as s:
                self._forecast = queries.pair_id(s, self.telemetry.pair) == fitted_on

    def _setup_features(self, categorize) -> None:
        """The key prompt features are computed under: the store's (its key file, created on
        first use), else $AUTOSPEC_FEATURE_KEY_FILE's, else one of this process alone (its
        features never leave it). Where the key cannot be read or created, serving goes on
        without features (logged once here; ``features_skipped`` counts the requests that
        went without). A categoriser fitted under another key is refused: an error when
        ``categorize`` named it, else a warning and no categories."""
        self.feature_key = None
        self.features_skipped = 0
        if self.categorizer is None and not (self.writer is not None and self.log_features):
            return
        from autospec.categorize.features import FeatureKey
        from autospec.store.keys import standalone_key

        try:
            self.feature_key = FeatureKey(self.store.feature_key() if self.store is not None
                                          else standalone_key())
        except Exception as e:  # FeatureKeyError (unreadable, cannot be created here) or worse
            log.warning("autospec: prompt features are off (requests are served and logged "
                        "without them, and not categorised): %s", e)
            self.categorizer = None
            return
        check = getattr(self.categorizer, "check_key", None)
        if check is None:
            return
        try:
            check(self.feature_key)
        except ValueError as e:
            if categorize is not None:
                raise
            log.warning("autospec: not categorising (requests without a category get "
                        "'default'): %s", e)
            self.categorizer = None
            self._forecast = False

    def _setup_metrics(self, option, names) -> None:
        """Prometheus metrics (autospec.fleet.metrics), updated once per finished request."""
        from autospec.fleet.metrics import RequestHook, as_metrics

        m = as_metrics(option)
        self.metrics = None if m is None else RequestHook(
            m, self.model, self.draft, names=names, telemetry=self.telemetry)

    def _open_store(self, store, names) -> None:
        """Open the store now, so a URL that reaches no database fails at wrap time; writes
        happen off the hot path on the writer's thread, and nothing it does can raise into
        generate. A store this autospec cannot write (``StoreUnusable``: a newer schema,
        read-only, damaged) does not stop serving: see ``_unusable``."""
        from autospec.store import Store, StoreUnusable, open_store
        from autospec.telemetry import RequestTelemetry

        self._owns_store = not isinstance(store, Store)
        if not self._owns_store:
            self.store = store
        else:
            try:
                self.store = open_store(store)
            except StoreUnusable as e:
                self.store = self._unusable(store, e)
        if self.store is None:
            return
        if not self.store.read_only:
            self.writer = self.store.writer()
        self.telemetry = RequestTelemetry(self.model, self.draft, names=names,
                                          cache_dir=_store_dir(self.store))
        # a controller dropped without close() still flushes its records and releases the
        # writer's thread and the store's files when it is collected
        self._release_store = weakref.finalize(
            self, _release_store, self.writer, self.telemetry,
            self.store if self._owns_store else None, 10.0)

    def _unusable(self, url, e):
        """Serving without telemetry: one warning saying why, the failure counted; a store
        this process may read but not write is still read (history, tuned parameters, the
        categoriser). The store read-only, or None."""
        from autospec.store import StoreDamaged, StoreError, StoreReadOnly, open_store

        store, reads = None, ""
        if isinstance(e, StoreReadOnly):
            try:
                store = open_store(url, read_only=True)
                reads = "; its history, tuned parameters and categoriser are still read"
            except StoreError as again:
                reads = f"; nothing is read from it either: {again}"
        self.store_failures += 1
        self.store_unusable = str(e)
        named = e.url and not isinstance(e, StoreDamaged)  # StoreDamaged names its file
        log.warning("autospec: serving without telemetry: %s%s%s",
                    f"the store {e.url} is unusable: " if named else "", e, reads)
        return store

    def close(self, timeout: float = 10.0) -> None:
        """Flush and close the store writer (also done at interpreter exit and by unwrap), and
        free the models' static caches and CUDA graphs (a later request builds them again)."""
        if self._owns_policy and hasattr(self.policy, "close"):
            self.policy.close()
        if self.static_cache:
            from autospec.engine.runners import release_runners

            release_runners(self.model)
            if self.draft is not None:
                release_runners(self.draft)
        if self._release_store is not None and self._release_store.detach() is not None:
            _release_store(self.writer, self.telemetry,
                           self.store if self._owns_store else None, timeout)
            self.writer = None

    @property
    def last_stats(self) -> LoopStats | None:
        """Counters of this thread's last request; None if it went to the original generate."""
        return getattr(self._local, "stats", None)

    # -- public API ----------------------------------------------------------------------
    def generate(self, inputs=None, generation_config=None, *args, category: str | None = None,
                 k: int | None = None, generator: torch.Generator | None = None,
                 explain: bool = False, tenant: str | None = None, **kwargs):
        """Same arguments and return types as transformers' ``generate``, plus:

        category: traffic category for statistics and policies (else the controller's, else
            the categoriser's guess from the prompt, else "default").
        k: a fixed lookahead for this call (0 = plain decoding), overriding the policy; a
            ``policies.Choice`` names the proposer too (``Choice(4, "ngram")``).
        generator: a ``torch.Generator`` for sampling (else torch's global RNG, like generate).
        explain: keep every iteration's decision record — the k and proposer chosen, the
            candidates weighed and each one's expected seconds per token
            (``autospec.policies.explain``) — on ``last_stats.decisions`` (a list of dicts,
            each the record plus "iteration"; at batch > 1 one per iteration of the batch) and
            in the store. Without it a store keeps a sample (the first iterations and every
            16th: ``autospec.engine.batch.WHY_KEPT``), also on ``last_stats.decisions``; with
            neither, None. A request served by the original generate has no record.
        tenant: whose requests this one is (else the controller's): suffix decoding drafts
            only from the earlier outputs of the same tenant and category, and remembers this
            output for them alone (None: for every request without a tenant). Not stored.
        """
        if not isinstance(explain, bool):
            raise ValueError(f"explain must be True or False, got {explain!r}")
        rows = _batch_of(inputs if inputs is not None else kwargs.get("input_ids"))
        category = _check_categories(category, rows)
        tenant = self.tenant if tenant is None else check_tenant(tenant)
        policy = self.policy if k is None else _fixed(_check_k(k, self.k_max), k)
        if self.suffix_memory is None and _needs_memory(policy):
            self._open_suffix()
        plan, reason = self._plan(inputs, generation_config, args, kwargs)
        self._local.stats = None
        self._local.row_stats = None
        if plan is None:
            return self._fallback(reason, inputs, generation_config, args, kwargs)
        return self._speculate(plan, policy, category, generator, k, kwargs.get("streamer"),
                               explain, tenant)

    def _open_suffix(self) -> None:
        """The suffix proposer's memory with its default settings (a policy asked for it)."""
        from autospec.suffix import SuffixMemory

        with self._lock:
            if self.suffix_memory is None:
                self.suffix_memory = SuffixMemory()

    @property
    def last_row_stats(self) -> list[LoopStats] | None:
        """Per-row counters of this thread's last request (``last_stats`` sums a batch's)."""
        return getattr(self._local, "row_stats", None)

    def _speculate(self, plan: Plan, policy, category, generator, k, streamer,
                   explain: bool = False, tenant: str | None = None):
        """A planned request through the engine (batch 1 is a batch of one); the output laid
        out as generate lays it out."""
        from autospec.engine.generate import run

        rows = plan.rows or ((plan.input_ids, plan.pad_prefix),)
        cats = category if isinstance(category, list) else [category] * len(rows)
        resolved = [self._categorise(c, ids) for c, (ids, _) in zip(cats, rows)]
        names = [r[0] for r in resolved]
        lives = [self.live_stats(c) for c in names]
        if plan.rows:
            self._warm_batched(names[0])
        res = run(
            self.model, self.draft, [ids for ids, _ in rows], sampling=plan.sampling,
            policy=policy, max_new_tokens=plan.max_new_tokens, categories=names,
            lives=lives, costs=self.costs,
            forecasts=[None if k is not None else r[3] for r in resolved],
            min_new_tokens=plan.min_new_tokens, eos_token_ids=plan.eos,
            stopping_criteria=plan.stopping_criteria, streamer=streamer, generator=generator,
            k_max=self.k_max, target_context=self.target_context,
            draft_context=self.draft_context, output_scores=plan.output_scores,
            output_logits=plan.output_logits, row_prefix=[pad for _, pad in rows],
            row_held=plan.held,
            record_confidence=self.writer is not None, options=self.options,
            memory=None if self.suffix_memory is None else self.suffix_memory.tenant(tenant),
            static_cache=self.static_cache, cuda_graphs=self.cuda_graphs,
            processors=plan.processors,
            keep_cache=plan.return_dict and plan.use_cache and self._own_cache_is_generates(plan),
            explain="all" if explain else "sample" if self.writer is not None else None)
        row_stats = [r.stats for r in res.rows]
        for st, live in zip(row_stats, lives):  # how long the category's requests run
            if live is not None:
                live.observe_length(st.new_tokens, capped(st.stop_reason))
        self._local.row_stats = row_stats
        self._local.stats = row_stats[0] if len(row_stats) == 1 else merge_stats(row_stats)
        if self.writer is not None:
            for row, (ids, pad), (cat, source, features, alpha) in zip(res.rows, rows, resolved):
                self._log(row, replace(plan, input_ids=ids, pad_prefix=pad), policy, cat,
                          source, features, alpha)
        if self.metrics is not None:
            for row, (cat, *_) in zip(res.rows, resolved):
                self.metrics.observe(row.stats, cat)
        if not plan.rows:
            sequences = res.rows[0].sequences
            if plan.held is not None:  # generate's input row, its holes included
                sequences = torch.cat([plan.held[0], sequences[:, plan.input_ids.shape[1]:]],
                                      dim=1)
            else:
                sequences = torch.cat([plan.pad_prefix, sequences], dim=1)
            scores = None if res.rows[0].scores is None else tuple(
                t[None] for t in res.rows[0].scores)
            logits = None if res.rows[0].logits is None else tuple(
                t[None] for t in res.rows[0].logits)
        else:
            steps = max(r.stats.new_tokens for r in res.rows)
            pad = plan.pad_token_id if plan.pad_token_id is not None else 0
            L = plan.padded.shape[1]
            sequences = torch.full((plan.batch, L + steps), pad, dtype=torch.long,
                                   device=plan.padded.device)
            sequences[:, :L] = plan.padded
            for b, row in enumerate(res.rows):
                new = row.sequences[0, row.stats.prompt_tokens:]
                sequences[b, L : L + new.shape[0]] = new
            scores = (_stack_steps([r.scores for r in res.rows], steps, pad)
                      if plan.output_scores else None)
            logits = (_stack_steps([r.logits for r in res.rows], steps, pad)
                      if plan.output_logits else None)
        if not plan.return_dict:
            return sequences
        cache = res.cache
        if plan.use_cache and cache is None:  # generate's cache, built from its sequences
            from autospec.engine.generate import generated_cache

            pads = [pad.shape[1] for _, pad in rows]
            if plan.from_embeds:  # the embedded prompt's tokens, then the output
                cache = generated_cache(self.model, torch.cat([plan.input_ids, sequences], 1),
                                        pads)
            else:
                cache = generated_cache(self.model, sequences, pads, mask=(
                    plan.attention_mask if plan.held is not None else None))
        return _output(sequences, scores, logits, cache)

    def _own_cache_is_generates(self, plan: Plan) -> bool:
        """Whether the engine's own target cache is the one generate returns: one row without
        padding, on the eager path, every layer keeping every token (no sliding window). Else
        the output's cache is built afterwards (``generated_cache``: one forward)."""
        return (not plan.rows and not plan.pad_prefix.shape[1]
                and (plan.held is None or plan.from_embeds) and not self.static_cache
                and not self.layouts[0].sliding)

    def _warm_batched(self, category: str) -> None:
        """Once, at the first batched call: the pair's batch grid on the batched loop's path
        (eager), warmed from the store as every reader sees it (``costs.stored.stored_costs``:
        the probe's shape at the level earlier batches measured, else their live points),
        and that path's batch-1 row (a batched call's one-row tail runs there) where it is
        not this controller's own."""
        if self._grid_warmed:
            return
        with self._lock:
            if self._grid_warmed:
                return
            self._grid_warmed = True
            if self.store is None:
                return
            from autospec.costs.stored import stored_costs
            from autospec.store import queries

            try:
                with self.store.session() as s:
                    pid = queries.pair_id(s, self.telemetry.pair)
                    if pid is None:
                        return
                    stored = stored_costs(s, pid, parts={"grid"})  # as the report reads it
                    self.costs.warm_grid(BATCHED, stored.grid, stored.draft_grid)
                    if BATCHED not in self._warmed:
                        self._warm_row(s, pid, category, BATCHED)
            except Exception as e:
                log.warning("autospec: could not warm batch costs from the store: %s", e)

    def live_stats(self, category: str) -> LiveStats:
        """The category's live statistics (its acceptance and rate), created on first use and
        warmed from the store — where the store has nothing of it, seeded from the pair's
        other categories here (``LiveStats.seed_from``); the first category's read also
        warms the pair's batch-1 costs on this controller's path (``costs``, which every
        category shares)."""
        live = self.live.get(category)
        if live is None:
            with self._lock:
                live = self.live.get(category)
                if live is None:
                    live = LiveStats(params=params_of(self.policy))
                    self._warm(category, live)
                    if not live.by_proposer:  # nothing stored: what the pair knows
                        live.seed_from(list(self.live.values()))
                    self.live[category] = live
        return live

    def _warm(self, category: str, live: LiveStats) -> None:
        """History of this category and pair from the store (a read, once per category;
        WAL readers never wait on writers): the category's acceptance and how long its
        requests ran (``queries.category_lengths``), and, where this
        controller's path is not warmed yet, its batch-1 costs (``_warm_row``: warmed once,
        then measured live, so a later category starts from what the process measured).
        Failures only cost the warm start."""
        if self.store is None:
            return
        from autospec.store import queries

        try:
            with self.store.session() as s:
                pid = queries.pair_id(s, self.telemetry.pair)
                if pid is None:
                    return
                sums = queries.category_summaries(s, category=category, pair_id=pid)
                lengths = queries.category_lengths(s, category, pid,
                                                   int(CONSTANTS.lengths_kept))
                if self.path not in self._warmed:
                    self._warm_row(s, pid, category, self.path)
            for n, capped in lengths:
                live.observe_length(n, capped)
            if sums:
                sm = sums[0]
                live.warm_start(sm.by_proposer, bandwidth_utilisation=sm.bandwidth_utilisation)
        except Exception as e:
            log.warning("autospec: could not warm category %r from the store: %s", category, e)

    def _warm_row(self, session, pid: int, category: str, path: str) -> None:
        """The pair's batch-1 row on ``path`` from the store, once: T_t(n) and T_d from one
        source (the probe if any, else well-measured live points) so their ratios hold, live
        timings then replacing them; the draft's catch-up fit (logged catch-ups, else the
        probe's); the lookups' time (``category``'s)."""
        from autospec.costs.stored import stored_costs

        self._warmed.add(path)
        c = stored_costs(session, pid, category, path=path,
                         parts={"batch1", "catch_up", "lookups"})
        row = self.costs.at(path, 1)
        row.warm_catch_up(c.catch_up)
        # a probe's curve is exempt from the shape guard (every n timed back to back); a
        # live one passes it again here, whoever stored it
        row.warm(c.t_target, c.t_draft, c.t_lookup, probe=c.from_probe)

    def _categorise(self, category: str | None, input_ids: torch.Tensor):
        """(category, how it was set, prompt features, predicted acceptance). Features are
        keyed hashes of token n-grams, never text; a categoriser failure falls back to
        "default"."""
        if category is None and self.category is not None:
            category = self.category
        want = self.categorizer is not None or (self.writer is not None and self.log_features)
        features = alpha = None
        if want and self.feature_key is None:
            self.features_skipped += 1  # no key here: logged once at wrap time
        elif want:
            from autospec.categorize.features import prompt_features

            features = prompt_features(input_ids[0], self.feature_key)
        if category is not None:
            return category, "given", features if self.log_features else None, None
        if self.categorizer is None:
            return "default", "default", features if self.log_features else None, None
        try:
            category, alpha = self.categorizer.predict(features)
            category = _check_category(category)
            alpha = alpha if self._forecast else None
        except Exception as e:
            self.categorize_failures = getattr(self, "categorize_failures", 0) + 1
            log.warning("autospec: categoriser failed (request served as 'default'): %s", e)
            return "default", "default", features if self.log_features else None, None
        return category, "auto", features if self.log_features else None, alpha

    def _log(self, res, plan: Plan, policy, category: str, source: str = "given",
             features: bytes | None = None, alpha: float | None = None) -> None:
        """Queue the request's record; a failure here is counted and logged, never raised."""
        try:
            prompt_text = output_text = None
            if self.log_text:
                prompt_text = self._text(res.sequences[0, : plan.input_ids.shape[1]])
                output_text = self._text(res.sequences[0, plan.input_ids.shape[1]:])
            record = self.telemetry.record(
                res.stats, category=category, policy=getattr(policy, "name", str(policy)),
                greedy=not plan.sampling.do_sample, prompt_text=prompt_text,
                output_text=output_text)
            record.category_source, record.features, record.predicted_alpha = (
                source, features, alpha)
            self.writer.submit(record)
        except Exception:
            self.store_failures += 1
            log.exception("autospec: could not queue the request's telemetry (generation is "
                          "unaffected); %d such failures so far", self.store_failures)

    def _text(self, ids: torch.Tensor) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return " ".join(str(i) for i in ids.tolist())

    # -- request analysis ------------------------------------------------------------------
    def _plan(self, inputs, generation_config, args, kwargs):
        """Either a plan for the loop, or (None, why the original generate must serve it)."""
        for layout in self.layouts:  # a model the engine cannot serve at all: say that
            if layout.problem is not None:
                return None, layout.problem
        plan, reason = plan_request(self.model, inputs, generation_config, args, kwargs,
                                    tokenizer=self.tokenizer,
                                    target_context=self.target_context)
        if plan is not None and plan.rows:  # what the engine's caches serve at batch > 1
            for layout in self.layouts:
                why = layout.batch_problem()
                if why is not None:
                    return None, why
        return plan, reason

    def _fallback(self, reason, inputs, generation_config, args, kwargs):
        with self._lock:
            first = reason not in self.fallbacks
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if first:
            log.info("autospec: %s; this request goes to the original generate", reason)
        if getattr(self, "metrics", None) is not None:
            self.metrics.fallback(reason)
        return self._original_generate(inputs, generation_config, *args, **kwargs)


def _output(sequences, scores, logits, cache):
    """generate's return_dict output (its field for the cache is ``cache`` in transformers
    5.x, ``past_key_values`` before)."""
    from dataclasses import fields

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    out = dict(sequences=sequences, scores=scores, logits=logits)
    names = {f.name for f in fields(GenerateDecoderOnlyOutput)}
    out["cache" if "cache" in names else "past_key_values"] = cache
    return GenerateDecoderOnlyOutput(**out)


def _release_store(writer, telemetry, store, timeout: float) -> None:
    """Flush and stop the writer, close telemetry and, where the controller opened it, the
    store: ``Controller.close``, or the controller's finalizer when it was dropped open."""
    if writer is not None:  # None: a store opened read-only
        writer.close(timeout=timeout)
    telemetry.close()
    if store is not None:
        store.close()


def _stack_steps(per_row: list[list[torch.Tensor]], steps: int, pad: int):
    """generate's layout: one [B, V] tensor per step. A row that finished earlier holds, at
    later steps, a distribution certain of the pad token its output holds there (generate
    computes throwaway scores for such rows)."""
    ref = next(t for r in per_row for t in r)
    filler = torch.full_like(ref, float("-inf"))
    filler[pad] = 0.0
    return tuple(torch.stack([r[t] if t < len(r) else filler for r in per_row])
                 for t in range(steps))


def _batch_of(input_ids) -> int | None:
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        return int(input_ids.shape[0])
    return None


def _check_categories(category, batch: int | None):
    """One name, or a list of one name per row (checked before any work)."""
    if category is None:
        return None
    if isinstance(category, (list, tuple)):
        if batch is None or len(category) != batch:
            raise ValueError(f"category= has {len(category)} names for a batch of "
                             f"{batch if batch is not None else 'unknown size'}: pass one name, "
                             "or a list with one name per row")
        return [_check_category(c) for c in category]
    return _check_category(category)


def _store_dir(store):
    """Where machine-level figures (the measured CPU bandwidth) are cached: beside a SQLite
    file this process writes, else the cache directory."""
    from autospec.store.database import _sqlite_file, cache_dir

    url = store.engine.url
    db = _sqlite_file(url) if url.get_backend_name() == "sqlite" and not store.read_only else None
    return str(cache_dir()) if not db or db == ":memory:" else os.path.dirname(os.path.abspath(db))


def _context_length(model) -> int | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(cfg, "max_position_embeddings", None)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_k_max(k_max) -> int:
    if not _is_int(k_max):
        raise TypeError(f"k_max must be a whole number of draft tokens in 1..{K_LIMIT}, got "
                        f"{k_max!r} ({type(k_max).__name__}): pass e.g. k_max=8")
    if not 0 < k_max <= K_LIMIT:
        raise ValueError(f"k_max must be in 1..{K_LIMIT}, got {k_max}: the most draft tokens "
                         "one iteration may propose")
    return int(k_max)


def _check_k(k, k_max: int) -> int:
    if not _is_int(k):
        raise TypeError(f"k must be a whole number of draft tokens in 0..{k_max}, got {k!r} "
                        f"({type(k).__name__}): pass e.g. k=4, or k=0 for plain decoding")
    if not 0 <= k <= k_max:
        raise ValueError(f"k must be in 0..{k_max} (k_max of this controller), got {k}")
    return int(k)


def _fixed(k: int, choice) -> FixedK:
    """The policy of a call's ``k=``: k from the proposer a ``Choice`` names (a plain int: the
    model proposer's)."""
    proposer, min_match, _fallback = proposer_of(choice)
    return FixedK(k, proposer, min_match)


def _needs_memory(policy) -> bool:
    """Whether a policy drafts with a proposer that needs the category memory (a
    ``"suffix:K"`` policy), so that a controller opens it; a name no proposer is registered
    under is refused (ValueError, ``refusal``)."""
    from autospec.engine.proposers import registered

    why = refusal(policy, has_draft=True)
    if why is not None:
        raise ValueError(why)
    known = registered()
    return any(n is not None and "memory" in known[n].needs for n in wanted(policy))


def _ngram_factory(ngram):
    """The n-gram proposer's factory from wrap's ``ngram=``: None (defaults), a dict of
    ``NgramIndex`` settings, or a callable ``tokens -> index``."""
    from functools import partial

    from autospec.ngram import NgramIndex

    if ngram is None:
        return NgramIndex
    if isinstance(ngram, dict):
        unknown = set(ngram) - {"max_n", "min_n"}
        if unknown:
            raise ValueError(f"ngram= takes max_n and min_n, got {sorted(unknown)}")
        NgramIndex((), **ngram)  # checks the sizes now, not at the first request
        return partial(NgramIndex, **ngram)
    if callable(ngram):
        return ngram
    raise TypeError(f"ngram= takes None, a dict (max_n, min_n) or a callable tokens -> index, "
                    f"got {type(ngram).__name__}")


def _check_category(category) -> str:
    """The store's rule (``autospec.store.record.check_category``), checked before any work
    so that a request whose record the store would refuse never runs."""
    from autospec.store.record import check_category

    return check_category(category)


def wrap(model, draft=None, **options) -> Controller:
    """Make ``model.generate`` speculative with ``draft`` (None: prompt lookup alone, the
    n-gram proposer: no draft model needed); returns the controller.

    Options: policy ("auto" (default), "costmodel", "bandit", "heuristic", an int k,
    "fixed:K", "off", "NAME+stop=P", a callable or a policy object), k_max (16), tokenizer / draft_tokenizer (checked to share token ids),
    match_draft (move/cast the draft to the target's device and dtype; default True),
    category (every request's category unless the call names one; None (default): the
    categoriser's guess from the prompt, else "default"), store (a SQLAlchemy URL or file path;
    None: autospec.db in the cache directory; False: no telemetry), log_text (store prompt and
    output text; default False), categorize (None: the store's "default" categoriser if one
    was fitted; a name; a Categorizer; False: never), log_features (store prompt-token
    n-grams hashed under the store's secret feature key, never text, so a categoriser can be
    fitted later; default True; docs/store.md),
    names ((target, draft) names for the store; default: the models' name_or_path),
    static_cache (False: transformers' DynamicCache, the reference; True: a static KV cache
    reused across requests), cuda_graphs ("auto": with static_cache on a CUDA device, replay
    the draft step and each verification size from CUDA graphs; True; False), metrics
    (True: count every request in Prometheus metrics named after vLLM's, served by
    ``autospec.fleet.metrics.start_http_server(port)``; an ``autospec.fleet.metrics.Metrics``; default
    False), ngram (the n-gram proposer's settings: ``dict(max_n=3, min_n=1)`` by default, or
    a callable ``tokens -> index`` with ``extend``/``propose``, see ``autospec.ngram``),
    suffix (the suffix proposer, ``autospec.suffix``: True for its defaults, a dict of
    ``SuffixSettings`` fields, or settings; it remembers the outputs of this process's
    earlier requests per tenant and category, never in the store, within ``max_bytes``; a
    ``"suffix:K"`` policy turns it on with its defaults; default None: off. What it drafts
    shows in acceptance and latency whether a continuation matches an earlier output of the
    same tenant and category: name a tenant per user who must not learn of another's
    outputs), tenant (every request's tenant unless the call names one; None (default):
    requests share the suffix memory per category; named like a category, never stored).
    """
    if getattr(model, "_autospec_controller", None) is not None:
        raise ValueError("this model is already wrapped: call autospec.unwrap(model) first")
    ctrl = Controller(model, draft, **options)

    def generate(self, *args, **kwargs):
        return ctrl.generate(*args, **kwargs)

    model.generate = types.MethodType(generate, model)
    model._autospec_controller = ctrl
    model.__deepcopy__ = types.MethodType(_deepcopy_unwrapped, model)
    model.__reduce_ex__ = types.MethodType(_refuse_pickle, model)
    return ctrl


_WRAP_ATTRS = ("generate", "_autospec_controller", "__deepcopy__", "__reduce_ex__")


def _deepcopy_unwrapped(self, memo):
    """``copy.deepcopy`` of a wrapped model: a copy of the model alone, unwrapped (the
    controller holds the draft, a store connection and threads, which a copy must not share
    or duplicate); wrap the copy to speculate with it. Done as deepcopy does it for an
    ``nn.Module`` (new object, deep-copied ``__dict__``, ``__setstate__``), minus wrap's
    attributes, without touching the original (which may be serving other threads)."""
    cls = type(self)
    new = cls.__new__(cls)
    memo[id(self)] = new
    state = {k: v for k, v in self.__dict__.items() if k not in _WRAP_ATTRS}
    new.__setstate__(copy.deepcopy(state, memo))
    log.info("autospec: deep-copied a wrapped %s: the copy is not wrapped (autospec.wrap it "
             "to speculate with it)", cls.__name__)
    return new


def _refuse_pickle(self, protocol):
    raise TypeError(
        f"a wrapped {type(self).__name__} cannot be pickled (or shallow-copied): its controller "
        "holds the draft, a store connection and threads. Pickle the model after "
        "autospec.unwrap(model), or pickle copy.deepcopy(model) (an unwrapped copy), and wrap "
        "it again after loading")


def unwrap(model):
    """Restore the model's own ``generate``; returns the model."""
    if getattr(model, "_autospec_controller", None) is None:
        raise ValueError("this model is not wrapped by autospec")
    ctrl = model._autospec_controller
    # the instance attributes: the class's generate, deepcopy and pickling show through again
    for name in ("generate", "__deepcopy__", "__reduce_ex__"):
        model.__dict__.pop(name, None)
    model._autospec_controller = None
    ctrl.close()
    return model
