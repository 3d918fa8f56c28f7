"""What a controller holds, and when it lets go.

Memory stays flat over many wrap → generate → unwrap cycles with the store on (the ORM's
unit of work kept a compiled UPDATE per mapper and per store a process had opened: about
0.1 MB a cycle). A controller dropped without ``close()`` flushes its records and releases
its writer's thread and the store's files when it is collected.
"""

from __future__ import annotations

import gc
import os
import threading
import tracemalloc

import torch

import autospec
from autospec.store import open_store, queries

from conftest import noisy_copy, prompt, tiny


def _writer_threads() -> int:
    return sum(t.name == "autospec-store-writer" and t.is_alive()
               for t in threading.enumerate())


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_memory_stays_flat_over_wrap_generate_unwrap_cycles(tmp_path):
    target = tiny("llama", sharpen=30.0)
    draft = noisy_copy(target, 0.3)
    url = f"sqlite:///{tmp_path / 'cycles.db'}"
    ids = prompt(10)

    def cycle():
        autospec.wrap(target, draft, store=url)
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                        do_sample=False)
        autospec.unwrap(target)

    for _ in range(20):  # caches that fill once (imports, compiled statements) fill here
        cycle()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(150):
            cycle()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 1.5e6, f"{grown / 1e6:.1f} MB more after 150 cycles"
    with open_store(url) as store, store.session() as s:
        (summary,) = queries.category_summaries(s)
    assert summary.requests == 170  # every cycle's request was logged


def test_a_controller_dropped_open_releases_its_writer_and_files(tmp_path):
    target = tiny("llama", sharpen=30.0)
    draft = noisy_copy(target, 0.3)
    url = f"sqlite:///{tmp_path / 'dropped.db'}"
    ids = prompt(10)
    gc.collect()
    threads, files = _writer_threads(), _open_files()
    for _ in range(10):
        spec = autospec.Controller(target, draft, store=url)
        spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                      do_sample=False)
        assert _writer_threads() == threads + 1  # its writer runs while it lives
        del spec  # never closed
        gc.collect()
    assert _writer_threads() == threads
    assert _open_files() <= files
    with open_store(url) as store, store.session() as s:
        (summary,) = queries.category_summaries(s)
    assert summary.requests == 10  # each flushed what it had queued
