"""The suffix proposer's memory (``autospec.suffix_memory``) under worst-case traffic: resident
memory (RSS) against its bound in bytes, and how long a lookup waits while a long output is
stored.

1. Many categories: --requests outputs of --output-tokens (after --prompt-tokens of prompt)
   spread over --categories categories, token ids drawn from --vocab, a third of each output
   copied from earlier outputs (what makes suffix decoding pay).
2. Long outputs: --long-outputs outputs of --long-tokens tokens over --long-categories
   categories (each fills its category's share; the bound forgets whole categories).
3. Lookups while a --long-tokens output is stored: another thread looks up, without pause,
   in the same category and in another; each lookup's wait is the time from the end of the
   previous one to its own end (so waiting for the interpreter before the call counts);
   printed are the worst and the median of those that ended during the insertion.

RSS is read from /proc/self/statm (else psutil) and printed above its level before the
memory was made, beside the memory's own count (``SuffixMemory.bytes``) and the bound
(``max_bytes``; --max-bytes, default the settings' default). Each part runs in a process of
its own, so that one's freed memory does not hide the next one's growth.

  .venv/bin/python scripts/bench_suffix_memory.py
  .venv/bin/python scripts/bench_suffix_memory.py --max-bytes 33554432 --categories 500
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import threading
import time

MB = 2**20


def rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def outputs(rng: random.Random, n: int, length: int, vocab: int, earlier: list[list[int]]):
    """``n`` outputs of ``length`` tokens, a third of each copied from recent ones."""
    for _ in range(n):
        out: list[int] = []
        while len(out) < length:
            if earlier and rng.random() < 0.33:
                src = rng.choice(earlier)
                a = rng.randrange(max(1, len(src) - 32))
                out += src[a : a + rng.randint(8, 32)]
            else:
                out += [rng.randrange(vocab) for _ in range(rng.randint(8, 32))]
        out = out[:length]
        earlier[:] = (earlier + [out])[-50:]
        yield out


def fill(args, part: str, queue) -> None:
    """Part 1 or 2 in this process: RSS growth and the memory's count, peak and end."""
    from autospec.suffix import SuffixMemory, SuffixSettings

    rng = random.Random(0)
    if part == "categories":
        n, length, cats = args.requests, args.output_tokens, args.categories
    else:
        n, length, cats = args.long_outputs, args.long_tokens, args.long_categories
    # the traffic is made first: its own lists are not the memory's growth
    traffic = [([rng.randrange(args.vocab) for _ in range(args.prompt_tokens)], out)
               for out in outputs(rng, n, length, args.vocab, [])]
    names = [f"c{rng.randrange(cats)}" for _ in range(n)]
    mem = SuffixMemory(SuffixSettings(max_bytes=args.max_bytes))
    start = peak = rss()
    counted = 0
    t0 = time.perf_counter()
    for name, (prompt, out) in zip(names, traffic):
        mem.remember(name, prompt, out)
        peak = max(peak, rss())
        counted = max(counted, mem.bytes)
    queue.put((part, n, length, cats, len(mem.categories()), (peak - start) / MB,
               (rss() - start) / MB, counted / MB, mem.bytes / MB, mem.evicted, mem.skipped,
               time.perf_counter() - t0))


def waits(args, queue) -> None:
    """Part 3 in this process: lookups on another thread while a long output is stored."""
    from autospec.suffix import SuffixMemory, SuffixSettings

    rng = random.Random(1)
    mem = SuffixMemory(SuffixSettings(max_bytes=args.max_bytes))
    earlier: list[list[int]] = []
    first, second = outputs(rng, 2, args.long_tokens, args.vocab, earlier)
    mem.remember("long", [1, 2, 3], first)  # the next one merges with it: the worst case
    for out in outputs(rng, 20, args.output_tokens, args.vocab, earlier):
        mem.remember("other", [1, 2, 3], out)
    contexts = {c: [earlier[-1][:40], first[1000:1040]] for c in ("long", "other")}
    started, done = threading.Event(), threading.Event()
    seen: dict[str, list[float]] = {"long": [], "other": []}

    def look() -> None:
        started.wait()
        i = 0
        last = time.perf_counter()
        while not done.is_set():
            cat = ("long", "other")[i % 2]
            mem.draft(cat, contexts[cat][(i // 2) % 2], 8)
            now = time.perf_counter()
            if not done.is_set():
                seen[cat].append(now - last)
            last = now
            i += 1

    th = threading.Thread(target=look)
    th.start()
    t0 = time.perf_counter()
    started.set()
    mem.remember("long", [1, 2, 3], second)
    took = time.perf_counter() - t0
    done.set()
    th.join()
    queue.put(("waits", took, {c: (len(v), max(v, default=0.0), statistics.median(v or [0.0]))
                               for c, v in seen.items()}))


def run(target, *a):
    queue = multiprocessing.get_context("fork").Queue()
    p = multiprocessing.get_context("fork").Process(target=target, args=(*a, queue))
    p.start()
    out = queue.get()
    p.join()
    return out


def main() -> None:
    from autospec.suffix import SuffixSettings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-bytes", type=int, default=SuffixSettings().max_bytes)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--categories", type=int, default=3000)
    ap.add_argument("--requests", type=int, default=30000)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--output-tokens", type=int, default=400)
    ap.add_argument("--long-outputs", type=int, default=48)
    ap.add_argument("--long-tokens", type=int, default=100_000)
    ap.add_argument("--long-categories", type=int, default=24)
    args = ap.parse_args()
    print(f"bound (max_bytes) {args.max_bytes / MB:.0f} MB; vocabulary {args.vocab}")
    print(f"{'traffic':>44} {'kept':>5} {'RSS peak':>9} {'RSS end':>8} {'counted peak':>13} "
          f"{'evicted':>8} {'skipped':>8} {'s':>6}")
    for part in ("categories", "long"):
        (_, n, length, cats, kept, peak, end, counted, _, evicted, skipped,
         took) = run(fill, args, part)
        what = f"{n} outputs of {length} tokens, {cats} categories"
        print(f"{what:>44} {kept:>5} {peak:>8.0f}M {end:>7.0f}M {counted:>12.0f}M "
              f"{evicted:>8} {skipped:>8} {took:>6.1f}")
        verdict = "within" if peak <= args.max_bytes / MB else "ABOVE"
        print(f"{'':>44} RSS growth {verdict} the bound")
    _, took, seen = run(waits, args)
    print(f"storing one {args.long_tokens}-token output (after another): {took * 1e3:.0f} ms")
    for cat, (n, worst, median) in seen.items():
        where = "same category" if cat == "long" else "other category"
        print(f"  lookups meanwhile, {where}: {n}, worst {worst * 1e3:.2f} ms, "
              f"median {median * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
