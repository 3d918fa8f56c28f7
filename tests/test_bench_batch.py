"""``autospec bench --batch``: grouping and padding, every mode at batch > 1, the summary math
and the command line, on tiny random-weight models (no downloads, no timing asserted)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from autospec.bench import run as bench
from autospec.bench.batch import make_batches, parse_batch_sizes, run_batched, until_stop
from autospec.bench.stats import BatchRecord, summarize_batches
from autospec.cli import build_parser, main
from autospec.cli.bench import format_table

from conftest import EOS, noisy_copy, tiny, tiny_tokenizer

TABLE = "policy:table:1-2:4,3-8:2,9-:0"
MODES = ["plain", "hf-assisted", "autospec:k", "policy:auto", TABLE]
# five prompts of lengths 5, 2, 4, 7, 3: at batch 2 the batches are (1, 4), (2, 0), (3)
TEXTS = ["w5 w6 w7 w8 w9", "w10 w11", "w12 w13 w14 w15", "w20 w21 w22 w23 w24 w25 w26",
         "w30 w31 w32"]
PROMPTS = [bench.Prompt("code" if i % 2 else "chat", t) for i, t in enumerate(TEXTS)]


@pytest.fixture(autouse=True)
def _one_thread_offline(monkeypatch):
    # the CLI sets the thread count process-wide; a test must never reach for the network
    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def pair():
    target = tiny("llama", sharpen=30.0)
    return target, noisy_copy(target, 0.5)


# -- grouping and padding ----------------------------------------------------------------
def test_batches_are_sorted_by_length_grouped_and_left_padded(tok):
    encoded = [bench.encode_prompt(tok, p) for p in PROMPTS]
    batches = make_batches(encoded, 2, tok)
    assert [b.indices for b in batches] == [(1, 4), (2, 0), (3,)]
    for b in batches:
        lengths = [encoded[i].shape[1] for i in b.indices]
        assert b.input_ids.shape == b.attention_mask.shape == (len(b.indices), max(lengths))
        for row, i in enumerate(b.indices):
            pad = max(lengths) - lengths[row]
            assert b.attention_mask[row].tolist() == [0] * pad + [1] * lengths[row]
            assert b.input_ids[row, pad:].tolist() == encoded[i][0].tolist()  # prompt at the right
            assert b.input_ids[row, :pad].tolist() == [tok.pad_token_id] * pad
    assert tok.padding_side == "right"  # the tokenizer is left as it was


def test_a_tokenizer_without_pad_token_pads_with_eos_and_keeps_its_settings(tok):
    t = copy.deepcopy(tok)
    t.pad_token = None
    encoded = [bench.encode_prompt(t, p) for p in PROMPTS[:2]]
    (batch,) = make_batches(encoded, 4, t)
    assert batch.indices == (1, 0)
    assert batch.input_ids[0, :3].tolist() == [t.eos_token_id] * 3
    assert t.pad_token is None and t.padding_side == "right"


def test_batch_of_one_is_each_prompt_unpadded(tok):
    encoded = [bench.encode_prompt(tok, p) for p in PROMPTS]
    batches = make_batches(encoded, 1, tok)
    assert [b.indices for b in batches] == [(1,), (4,), (2,), (0,), (3,)]
    assert all(bool(b.attention_mask.all()) for b in batches)


def test_rows_count_up_to_their_own_stop():
    assert until_stop([5, 6, EOS, EOS, EOS], (EOS,)) == [5, 6, EOS]
    assert until_stop([5, 9, 6, 9], (EOS, 9)) == [5, 9]
    assert until_stop([5, 6], (EOS,)) == [5, 6]


# -- the driver on models ----------------------------------------------------------------
def test_every_mode_runs_at_batch_1_and_2_and_greedy_rows_equal_plain(pair, tok):
    target, draft = pair
    res = bench.run_bench(target, draft, tok, PROMPTS, ks=[2], modes=MODES, max_new_tokens=8,
                          repeats=1, progress=False, batch_sizes=(1, 2))
    rows = {(r["batch"], r["mode"]): r for r in res.batches}
    names = ["plain", "hf-assisted", "autospec:2", "policy:auto", TABLE]
    assert list(rows) == [(b, m) for b in (1, 2) for m in names]
    assisted = rows[(2, "hf-assisted")]
    assert assisted["status"] == "unsupported" and "batch" in assisted["reason"]
    assert assisted["tokens_per_s"] is None and assisted["runs"] == 0
    assert rows[(1, "hf-assisted")]["status"] == "ok"  # batch 1 runs as before
    for (size, mode), row in rows.items():
        if row["status"] == "unsupported":
            continue
        assert row["rows"] == len(PROMPTS), (size, mode)
        assert row["identical_rows"] == row["rows"], (size, mode)
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0
        assert row["groups"] == (5 if size == 1 else 3)
    assert rows[(2, "plain")]["speedup"] == pytest.approx(1.0)
    assert res.meta["batch"] == [1, 2] and res.meta["batches"] == {"2": 3}
    assert {r.batch for r in res.batch_records} == {2}
    assert all(r["batch"] == 1 for r in res.rows)  # the per-category rows are batch 1's
    assert target.generate.__func__ is type(target).generate  # never left wrapped


def test_batch_rows_stop_at_their_own_eos_and_count_no_padding(pair, tok):
    target, draft = copy.deepcopy(pair[0]), pair[1]
    probe = bench.run_bench(target, draft, tok, PROMPTS, ks=[2], modes=[], max_new_tokens=8,
                            repeats=1, warmup=False, progress=False)
    first = probe.records[0].tokens
    # a second EOS id that ends prompt 0's output after 3 tokens, and others' wherever it comes
    stop = next(t for t in first[2:] if t not in first[:2])
    target.generation_config.eos_token_id = [EOS, stop]
    res = bench.run_bench(target, draft, tok, PROMPTS, ks=[2], modes=["autospec:k"],
                          max_new_tokens=8, repeats=1, warmup=False, progress=False,
                          batch_sizes=(1, 2))
    single = {r.prompt_index: r.tokens for r in res.records if r.mode == "plain"}
    assert len(single[0]) < 8 and single[0][-1] == stop
    for r in res.batch_records:
        for i, row in zip(r.prompt_indices, r.rows, strict=True):
            assert row == single[i], (r.mode, i)  # padding after a row's stop is not counted
        assert r.new_tokens == sum(len(single[i]) for i in r.prompt_indices)


def test_a_controller_without_batch_support_is_reported_as_a_fallback(pair, tok):
    target, draft = pair
    runner = bench._Runner(target, draft, tok, draft_tokenizer=None,
                           modes=bench.parse_modes(["autospec:2"], [2]), sample=False,
                           sampling={})
    calls = []

    class OldController:  # the controller before batches: category must be one string
        fallbacks: dict = {}
        last_stats = None

        def generate(self, *, category, k, generator, **kw):
            calls.append(category)
            if not isinstance(category, (str, type(None))):
                raise ValueError("category must be a non-empty string")
            self.fallbacks = {"batch size 2 (the loop serves batch 1)": len(calls)}
            return runner.generate(**kw)

    runner.ctrl = OldController()
    encoded = [bench.encode_prompt(tok, p) for p in PROMPTS]
    batches = make_batches(encoded, 2, tok)

    class Bar:
        def set_postfix_str(self, *a, **kw): ...
        def update(self): ...

    modes = bench.parse_modes(["autospec:2"], [2])
    records, refused = run_batched(runner, batches, modes, batch_size=2,
                                   categories=[p.category for p in PROMPTS], repeats=1,
                                   max_new_tokens=6, seed=0, warmup=False, bar=Bar())
    assert refused == {}
    assert calls[:2] == [["code", "chat"], None] and None in calls[2:]
    assert ["code", "chat"] not in calls[2:]  # asked once, then batches go without
    summary = {r["mode"]: r for r in summarize_batches(records, greedy=True)}
    assert summary["autospec:2"]["status"] == "fallback"
    assert "batch size 2" in summary["autospec:2"]["reason"]
    assert summary["plain"]["identical_rows"] == summary["autospec:2"]["identical_rows"] == 5


def test_a_table_policy_autospec_cannot_parse_is_unsupported_not_fatal(pair, tok, monkeypatch):
    import autospec.controller as controller

    real = controller.as_policy

    def without_table(spec):
        if isinstance(spec, str) and spec.startswith("table:"):
            raise ValueError(f"unknown policy {spec!r}")
        return real(spec)

    monkeypatch.setattr(controller, "as_policy", without_table)
    target, draft = pair
    res = bench.run_bench(target, draft, tok, PROMPTS[:2], ks=[1], modes=["autospec:k", TABLE],
                          max_new_tokens=4, repeats=1, warmup=False, progress=False,
                          batch_sizes=(1, 2))
    rows = {(r["batch"], r["mode"]): r for r in res.batches}
    for size in (1, 2):
        assert rows[(size, TABLE)]["status"] == "unsupported"
        assert "unknown policy" in rows[(size, TABLE)]["reason"]
        assert rows[(size, "autospec:1")]["status"] == "ok"
    assert not any(r.mode == TABLE for r in res.records + res.batch_records)
    table = format_table(res)
    assert f"{TABLE} at batch 2: unsupported (unknown policy" in table


# -- the summary, on hand-made records ---------------------------------------------------
def brec(mode, group, repeat, wall, rows, **kw):
    return BatchRecord(batch=4, group=group, prompt_indices=list(range(len(rows))),
                       repeat=repeat, mode=mode, k=None, new_tokens=sum(map(len, rows)),
                       wall_s=wall, rows=[list(r) for r in rows], **kw)


def test_summary_sums_tokens_over_a_repeat_and_pairs_speedups_per_batch():
    two = [(1, 2, 3), (4, 5)]  # 5 tokens
    records = [
        brec("plain", 0, 0, 1.0, two), brec("plain", 1, 0, 4.0, two),
        brec("plain", 0, 1, 1.0, two), brec("plain", 1, 1, 1.0, two),
        brec("auto", 0, 0, 0.5, two, drafted=10, accepted=5, k_schedule=[2, 2, 0],
             peak_kv_bytes=100),
        brec("auto", 1, 0, 1.0, [(1, 2, 3), (4, 9)], drafted=10, accepted=1, k_schedule=[2],
             peak_kv_bytes=300),
        brec("auto", 0, 1, 2.0, two), brec("auto", 1, 1, 2.0, two),
    ]
    rows = {r["mode"]: r for r in summarize_batches(records, greedy=True,
                                                    unsupported={(4, "hf"): "refused"})}
    assert rows["plain"]["tokens_per_s"] == pytest.approx((10 / 5 + 10 / 2) / 2)  # 2 and 5
    auto = rows["auto"]
    assert auto["tokens_per_s"] == pytest.approx((10 / 1.5 + 10 / 4) / 2)
    # paired ratios 2, 4, 0.5, 0.5 → median 1.25
    assert auto["speedup"] == pytest.approx(1.25)
    assert auto["acceptance"] == pytest.approx(6 / 20)
    assert auto["k_counts"] == {"0": 1, "2": 3} and auto["peak_kv_bytes"] == 300
    assert (auto["identical_rows"], auto["rows"]) == (7, 8)
    assert rows["hf"]["status"] == "unsupported" and rows["hf"]["reason"] == "refused"
    assert rows["plain"]["peak_kv_bytes"] is None  # unknown is not 0
    sampled = summarize_batches(records, greedy=False)
    assert all(r["identical_rows"] is None for r in sampled)


def test_each_policy_meets_the_best_of_plain_and_fixed_k_batch_by_batch():
    """At batch 4, three batches × two repeats: k = 2 has the best median speedup over plain
    (2 against k = 1's 1.25), so the policy is paired with k = 2 on each (batch, repeat): its
    seconds per token over k = 2's, median with a bootstrap interval, the batches where it was
    faster, and the ratio of throughputs. Where no fixed k beats plain, plain is the baseline."""
    from autospec.bench.stats import head_to_head

    two = [(1, 2, 3), (4, 5)]  # 5 tokens
    walls = {"plain": [2.0] * 6, "autospec:1": [1.6] * 6,
             "autospec:2": [1.0, 1.2, 0.8, 1.0, 0.9, 1.1], "policy:auto": [1.0] * 6}
    records = [brec(mode, g, rep, ws[2 * g + rep], two) for mode, ws in walls.items()
               for g in range(3) for rep in range(2)]
    batches = summarize_batches(records, greedy=True)
    (h,) = head_to_head([], [], batch_records=records, batches=batches)
    assert (h["mode"], h["against"], h["baseline"], h["batch"]) == (
        "policy:auto", "autospec:2", "best at batch", 4)
    ratios = sorted(walls["autospec:2"])  # k = 2's seconds per token over the policy's
    assert h["requests"] == 6 and h["median_ratio"] == pytest.approx((ratios[2] + ratios[3]) / 2)
    assert h["faster"] == 2  # 1.2 and 1.1 s against the policy's 1.0; 1.0 is a tie
    assert h["throughput_ratio"] == pytest.approx(6.0 / 6.0)
    low, high = h["interval"]
    assert ratios[0] <= low <= h["median_ratio"] <= high <= ratios[-1]
    # no fixed k beats plain: the policy is set against plain batched decoding
    slow = [r for r in records if r.mode != "autospec:2"] + [
        brec("autospec:3", g, rep, 3.0, two) for g in range(3) for rep in range(2)]
    plain_best = [dict(r, speedup=0.9) if r["mode"] == "autospec:1" else r
                  for r in summarize_batches(slow, greedy=True)]
    (h,) = head_to_head([], [], batch_records=slow, batches=plain_best)
    assert h["against"] == "plain" and h["median_ratio"] == pytest.approx(2.0)
    res = bench.BenchResult(meta={"target": "t", "draft": "d", "device": "cpu",
                                  "dtype": "float32", "threads": 1, "prompts": 6, "repeats": 2,
                                  "max_new_tokens": 4, "sample": False, "batch": [4],
                                  "batches": {"4": 3}},
                            rows=[], records=[], batches=plain_best, batch_records=slow,
                            head_to_head=[h])
    assert ("batch 4: policy:auto against plain (the best of plain and fixed k at this size), "
            "batch by batch: 2.00x by the median") in format_table(res)


def test_rows_that_differ_from_plain_are_explained_by_the_targets_margin_there(pair):
    """A batch row that parts from plain's: the target's top-2 logit margin where it first
    parts (a forward of the prompt + plain's row up to there), per row, in the summary, and
    one line per mode saying whether every difference is a rounding near-tie."""
    from autospec.cli.bench import _divergence_notes

    target = pair[0]

    class Runner:  # bench._Runner's margin: the real target's forward
        def top2_margin(self, ids, prefix):
            return bench.top2_margin(target, ids, prefix)

    encoded = [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10]]), torch.tensor([[11]])]
    rows = [(20, 21, 22), (30, 31), (40, 41, 42)]
    records = [brec("plain", 0, 0, 1.0, rows),
               # row 1 parts at its second token, row 2 stops one token early
               brec("auto", 0, 0, 1.0, [(20, 21, 22), (30, 99), (40, 41)])]
    bench._explain_batch_divergences(records, encoded, Runner())
    margin = bench.top2_margin(target, encoded[1], [30])
    assert records[0].margins == {} and records[1].margins == {1: margin, 2: None}
    auto = {r["mode"]: r for r in summarize_batches(records, greedy=True)}["auto"]
    assert (auto["identical_rows"], auto["rows"]) == (1, 3)
    assert auto["diverged_margins"] == [margin]
    near = dict(auto, diverged_margins=[0.1, 0.3])
    (line,) = _divergence_notes([near], "bfloat16")
    assert "auto at batch 4: 2 rows differ" in line and "near-tie" in line and "0.300" in line
    # one measured at a near-tie, one stops early
    (line,) = _divergence_notes([dict(auto, diverged_margins=[0.2])], "bfloat16")
    assert "1 stops at another length" in line
    (line,) = _divergence_notes([dict(near, diverged_margins=[0.1, 2.5])], "bfloat16")
    assert "1 first part" in line and "please report" in line
    (line,) = _divergence_notes([near], "float32")  # fp32 has no near-tie excuse
    assert "please report" in line
    assert _divergence_notes([dict(near, identical_rows=3)], "bfloat16") == []


def test_json_carries_every_batch_size_and_stays_compatible(tmp_path):
    records = [brec("plain", 0, 0, 1.0, [(1, 2)]), brec("auto", 0, 0, 0.5, [(1, 2)])]
    meta = {"target": "t", "draft": "d", "device": "cpu", "dtype": "float32", "threads": 1,
            "prompts": 1, "repeats": 1, "max_new_tokens": 4, "sample": False, "batch": [4],
            "batches": {"4": 1}}
    res = bench.BenchResult(meta=meta, rows=[], records=[],
                            batches=summarize_batches(records, greedy=True),
                            batch_records=records)
    res.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert {"meta", "rows", "runs", "batches", "batch_runs"} <= data.keys()
    assert [b["batch"] for b in data["batches"]] == [4]
    assert [r["mode"] for r in data["batches"][0]["rows"]] == ["plain", "auto"]
    assert all("rows" not in r and r["batch"] == 4 for r in data["batch_runs"])
    text = format_table(res)
    assert "batch sizes: 4" in text and "1/1" in text and "n/a" in text


# -- the command line --------------------------------------------------------------------
def test_batch_sizes_parse_sorted_and_once():
    assert parse_batch_sizes("16, 1,4,4") == [1, 4, 16]
    assert build_parser().parse_args(["bench"]).batch == [1]
    assert build_parser().parse_args(["bench", "--batch", "4,1"]).batch == [1, 4]


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--batch", "0"], "argument --batch: every batch size must be in 1..4096, got [0]"),
    (["bench", "--batch", "x"], "argument --batch: expected comma-separated batch sizes"),
    (["bench", "--batch", "1,-2"], "got [-2]"),
    (["bench", "--batch", ","], "expected at least one batch size"),
    (["bench", "--table", "banana"], "--table:"),
])
def test_bad_batch_arguments_are_messages_not_tracebacks(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_bench_at_batch_sizes_adds_table_and_auto_and_writes_them(pair, tok, tmp_path,
                                                                       capsys):
    for name, model in zip(("target", "draft"), pair, strict=True):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": p.category, "prompt": p.prompt})
                                 for p in PROMPTS[:3]))
    out_json = tmp_path / "out.json"
    code = main(["bench", "--target", str(tmp_path / "target"), "--draft",
                 str(tmp_path / "draft"), "--prompts", str(prompts), "--k", "2", "--repeats",
                 "2", "--repeats-batch1", "1", "--max-new-tokens", "4", "--modes", "autospec:k",
                 "--batch", "1,2",
                 "--json", str(out_json), "--dtype", "fp32", "--threads", "1", "--no-warmup"])
    assert code == 0
    out = capsys.readouterr().out
    assert "batch sizes: 1, 2" in out and "k schedule" in out
    assert "3 prompts x 1 repeat at batch 1, 2 at larger sizes" in out
    data = json.loads(out_json.read_text())
    assert data["meta"]["modes"] == ["plain", "autospec:2", "policy:auto", TABLE]
    assert [b["batch"] for b in data["batches"]] == [1, 2]
    for b in data["batches"]:
        assert [r["mode"] for r in b["rows"]] == data["meta"]["modes"]
        done = [r for r in b["rows"] if r["status"] != "unsupported"]
        # 3 prompts alone once at batch 1; 2 batches (2 + 1 prompts) twice at batch 2
        assert all(r["runs"] == (3 if b["batch"] == 1 else 4) for r in done)
        assert all(r["identical_rows"] == r["rows"] == 3 * (1 if b["batch"] == 1 else 2)
                   for r in done)
