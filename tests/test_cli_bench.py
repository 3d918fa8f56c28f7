"""The benchmark and the ``autospec`` command, on tiny random-weight models (no downloads).

Timings are never asserted: only structure, the aggregation math, exactness and error messages.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from autospec.bench import run as bench
from autospec.bench.run import Prompt, PromptFileError, RunRecord
from autospec.cli import main
from autospec.cli.bench import format_table

REQUIRED = {"category", "mode", "k", "tokens_per_s", "speedup", "acceptance", "identical"}
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models gain nothing from threads, and the CLI sets the count process-wide
    import transformers

    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a test must never reach for the network


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with no merges: 3 special tokens + 256 bytes, round-trips any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    """fp32 target and a draft that agrees with it partly (noisy copy), so both accepted and
    rejected drafts occur."""
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # peaked distributions: a realistic mix of accepts
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std().clamp_min(1e-3))
    return target, draft


PROMPTS = [Prompt("code", "def add(a, b):", False), Prompt("code", "Write a sort", True),
           Prompt("chat", "Explain threads.", True), Prompt("chat", "hello there", False)]


# -- the driver on models ----------------------------------------------------------------
def test_run_bench_rows_have_required_keys_and_greedy_autospec_is_identical(models, tok):
    target, draft = models
    res = bench.run_bench(target, draft, tok, PROMPTS, ks=[2], modes=["autospec:k"],
                          max_new_tokens=12, repeats=1, progress=False)
    keys = {(r["category"], r["mode"]) for r in res.rows}
    assert keys == {(c, m) for c in ("code", "chat", "overall") for m in ("plain", "autospec:2")}
    for row in res.rows:
        assert REQUIRED <= row.keys()
        assert row["identical"] is True
        assert row["divergences"] == []
    spec = next(r for r in res.rows if r["category"] == "overall" and r["mode"] == "autospec:2")
    assert spec["k"] == 2 and 0.0 <= spec["acceptance"] <= 1.0
    assert spec["speedup"] > 0 and spec["tokens_per_s"] > 0
    assert len(res.records) == len(PROMPTS) * 2
    assert res.meta["dtype"] == "float32" and res.meta["threads"] == 1
    assert target.generate.__func__ is type(target).generate  # never left wrapped


def test_hf_assisted_modes_count_acceptance_and_restore_the_draft_config(models, tok):
    target, draft = models
    before = draft.generation_config.to_dict()
    res = bench.run_bench(target, draft, tok, PROMPTS[:2], ks=[3],
                          modes=["hf-assisted", "hf-assisted:k"], max_new_tokens=10, repeats=1,
                          warmup=False, progress=False)
    assert draft.generation_config.to_dict() == before
    fixed = next(r for r in res.rows if r["category"] == "overall" and r["mode"] == "hf-assisted:3")
    assert 0.0 <= fixed["acceptance"] <= 1.0
    assert 1.0 <= fixed["tokens_per_forward"] <= 4.0  # at most k + 1 tokens per verification


def test_sampled_bench_reports_no_identity(models, tok):
    target, draft = models
    res = bench.run_bench(target, draft, tok, PROMPTS[:1], ks=[2], modes=["autospec:k"],
                          max_new_tokens=6, repeats=1, sample=True, sampling={"temperature": 0.8},
                          warmup=False, progress=False)
    assert all(r["identical"] is None for r in res.rows)


# -- aggregation on hand-made records ----------------------------------------------------
def rec(mode, prompt_index, repeat, wall, *, category="code", tokens=(1, 2, 3, 4), **kw):
    k = int(mode.split(":")[1]) if ":" in mode else None
    return RunRecord(category=category, prompt_index=prompt_index, repeat=repeat, mode=mode, k=k,
                     new_tokens=len(tokens), wall_s=wall, tokens=list(tokens), **kw)


def test_aggregate_medians_and_paired_speedup():
    records = [
        rec("plain", 0, 0, 2.0), rec("plain", 1, 0, 4.0), rec("plain", 2, 0, 1.0),
        rec("autospec:2", 0, 0, 1.0, drafts=2, drafted=4, accepted=3, target_forwards=2),
        rec("autospec:2", 1, 0, 1.0, drafts=2, drafted=4, accepted=1, target_forwards=3),
        rec("autospec:2", 2, 0, 2.0, drafts=1, drafted=2, accepted=0, target_forwards=4),
    ]
    rows = {(r["category"], r["mode"]): r for r in bench.aggregate(records, greedy=True)}
    spec = rows[("code", "autospec:2")]
    assert spec["tokens_per_s"] == pytest.approx(4.0)  # median of 4, 4, 2 tok/s
    assert spec["speedup"] == pytest.approx(2.0)  # paired ratios 2, 4, 0.5 → median 2
    assert rows[("code", "plain")]["speedup"] == pytest.approx(1.0)
    assert rows[("code", "plain")]["tokens_per_s"] == pytest.approx(2.0)  # 2, 1, 4
    assert spec["acceptance"] == pytest.approx(4 / 10)  # pooled, not a mean of ratios
    assert spec["mean_accepted_length"] == pytest.approx(1 + 4 / 5)
    assert spec["tokens_per_forward"] == pytest.approx(12 / 9)
    assert spec["identical"] is True and rows[("overall", "autospec:2")]["runs"] == 3


def test_aggregate_pairs_by_prompt_and_repeat_and_flags_differences():
    records = [
        rec("plain", 0, 0, 1.0, category="a"), rec("plain", 0, 1, 3.0, category="a"),
        rec("plain", 1, 0, 1.0, category="b"),
        rec("autospec:4", 0, 0, 1.0, category="a"), rec("autospec:4", 0, 1, 1.0, category="a"),
        rec("autospec:4", 1, 0, 2.0, category="b", tokens=(1, 2, 9, 4)),
    ]
    rows = {(r["category"], r["mode"]): r for r in bench.aggregate(records, greedy=True)}
    assert rows[("a", "autospec:4")]["speedup"] == pytest.approx(2.0)  # ratios 1 and 3
    assert rows[("b", "autospec:4")]["identical"] is False
    assert rows[("a", "autospec:4")]["identical"] is True
    assert rows[("overall", "autospec:4")]["identical"] is False
    assert rows[("a", "autospec:4")]["acceptance"] is None  # nothing drafted is "unknown"
    assert [r["category"] for r in bench.aggregate(records, greedy=True)][-1] == "overall"


def test_speedup_is_per_token_when_lengths_differ():
    records = [rec("plain", 0, 0, 2.0, tokens=(1, 2, 3, 4)),
               rec("autospec:2", 0, 0, 1.0, tokens=(5, 6))]
    rows = bench.aggregate(records, greedy=False)
    assert rows[1]["speedup"] == pytest.approx(1.0)  # 0.5 s/token both
    assert rows[1]["identical"] is None  # sampling: outputs are not expected to match


def test_each_policy_meets_the_best_fixed_k_request_by_request():
    """Six requests: k = 2 is the best fixed k (median speedup 2 against k = 1's 1.5); the
    policy runs them at 1 s/token against k = 2's 1.0, 0.9, 1.1, 1.2, 0.8, 1.3 s/token: the
    paired ratios' median is 1.05, it was faster on 3 of 6, and the throughput ratio is
    the summed tokens over summed seconds of each (6 s against 6.3 s for 24 tokens each)."""
    walls = {"plain": [8.0] * 6, "autospec:1": [8 / 1.5] * 6,
             "autospec:2": [4.0, 3.6, 4.4, 4.8, 3.2, 5.2], "policy:auto": [4.0] * 6}
    def run(mode, i, wall):
        if mode.startswith("policy:"):
            return RunRecord(category="code", prompt_index=i, repeat=0, mode=mode, k=None,
                             new_tokens=4, wall_s=wall, tokens=[1, 2, 3, 4])
        return rec(mode, i, 0, wall)

    records = [run(mode, i, w) for mode, ws in walls.items() for i, w in enumerate(ws)]
    rows = bench.aggregate(records, greedy=True)
    (h,) = bench.head_to_head(records, rows)
    assert (h["mode"], h["against"], h["requests"]) == ("policy:auto", "autospec:2", 6)
    ratios = sorted(w / 4.0 for w in walls["autospec:2"])
    assert h["median_ratio"] == pytest.approx((ratios[2] + ratios[3]) / 2)
    assert h["faster"] == 3
    assert h["throughput_ratio"] == pytest.approx(sum(walls["autospec:2"]) / 24.0)
    low, high = h["interval"]
    assert ratios[0] <= low <= h["median_ratio"] <= high <= ratios[-1] and low < high
    assert bench.head_to_head(records, rows) == [h]  # seeded: the same interval again
    # a policy faster on every request is faster by the median and the whole interval
    fast = [run("policy:fast", i, 2.0) for i in range(6)]
    (_, h2) = bench.head_to_head(records + fast, bench.aggregate(records + fast, greedy=True))
    assert h2["faster"] == 6 and h2["interval"][0] > 1
    res = bench.BenchResult(meta={"target": "t", "draft": "d", "device": "cpu",
                                  "dtype": "float32", "threads": 1, "prompts": 6,
                                  "repeats": 1, "max_new_tokens": 4, "sample": False},
                            rows=rows, records=records, head_to_head=[h])
    assert ("policy:auto against autospec:2 (the best fixed k here)" in format_table(res))
    assert res.to_json()["head_to_head"][0]["against"] == "autospec:2"
    # no fixed k in the run: nothing to compare with
    no_fixed = [r for r in records if not r.mode.startswith("autospec:")]
    assert bench.head_to_head(no_fixed, bench.aggregate(no_fixed, greedy=True)) == []


def test_each_policy_meets_prompt_lookup_per_category():
    """A policy is also set against every prompt-lookup mode of the run (transformers' and
    autospec's n-gram alone), over all requests and per category: on "copy" (4 requests) it
    runs 2 s per request where hf-lookup runs 2, 2.4, 1.8 and 2.2 s; on "chat" (2 requests)
    1 s where hf-lookup runs 3 s. The best fixed k comes first, the lookup modes in run
    order."""
    walls = {"plain": [8.0] * 6, "autospec:2": [4.0] * 6,
             "hf-lookup": [2.0, 2.4, 1.8, 2.2, 3.0, 3.0], "ngram:10": [1.0] * 6,
             "policy:auto": [2.0, 2.0, 2.0, 2.0, 1.0, 1.0]}

    def run(mode, i, wall):
        cat = "copy" if i < 4 else "chat"
        if not mode.startswith("autospec:") and mode != "plain":
            return RunRecord(category=cat, prompt_index=i, repeat=0, mode=mode, k=None,
                             new_tokens=4, wall_s=wall, tokens=[1, 2, 3, 4])
        return rec(mode, i, 0, wall, category=cat)

    records = [run(mode, i, w) for mode, ws in walls.items() for i, w in enumerate(ws)]
    fixed, hf, ng = bench.head_to_head(records, bench.aggregate(records, greedy=True))
    assert [(h["against"], h["baseline"]) for h in (fixed, hf, ng)] == [
        ("autospec:2", "fixed-k"), ("hf-lookup", "prompt-lookup"), ("ngram:10", "prompt-lookup")]
    copy, chat = hf["by_category"]["copy"], hf["by_category"]["chat"]
    assert copy["requests"] == 4 and copy["median_ratio"] == pytest.approx((1.0 + 1.1) / 2)
    assert copy["faster"] == 2  # 2.4 and 2.2 s against 2; 1.8 s was faster; 2.0 is a tie
    assert copy["throughput_ratio"] == pytest.approx(8.4 / 8.0)
    assert chat["median_ratio"] == pytest.approx(3.0) and chat["faster"] == 2
    assert hf["requests"] == 6 and hf["median_ratio"] == pytest.approx((1.1 + 1.2) / 2)
    assert ng["by_category"]["copy"]["median_ratio"] == pytest.approx(0.5)
    assert ng["by_category"]["copy"]["faster"] == 0
    res = bench.BenchResult(meta={"target": "t", "draft": "d", "device": "cpu",
                                  "dtype": "float32", "threads": 1, "prompts": 6,
                                  "repeats": 1, "max_new_tokens": 4, "sample": False},
                            rows=bench.aggregate(records, greedy=True), records=records,
                            head_to_head=[fixed, hf, ng])
    text = format_table(res)
    assert "policy:auto against hf-lookup (transformers' prompt lookup)" in text
    assert "policy:auto against ngram:10 (autospec's prompt lookup alone)" in text
    assert "copy 1.05x (" in text and "chat 3.00x (3.00-3.00, 2/2)" in text
    assert res.to_json()["head_to_head"][1]["by_category"]["chat"]["faster"] == 2


@pytest.mark.parametrize(("a", "b", "pos"), [((1, 2, 3), (1, 2, 3), None),
                                             ((1, 2, 3), (1, 5, 3), 1),
                                             ((1, 2), (1, 2, 3), 2)])
def test_first_divergence(a, b, pos):
    assert bench.first_divergence(a, b) == pos


def test_json_and_table_follow_the_schema(tmp_path):
    records = [rec("plain", 0, 0, 1.0), rec("hf-assisted:2", 0, 0, math.nan),
               rec("autospec:2", 0, 0, 0.5, drafts=1, drafted=2, accepted=2, target_forwards=2,
                   t_target_1=math.nan, t_draft=0.01)]
    meta = {"target": "t", "draft": "d", "device": "cpu", "dtype": "float32", "threads": 1,
            "prompts": 1, "repeats": 1, "max_new_tokens": 4, "sample": False}
    res = bench.BenchResult(meta=meta, rows=bench.aggregate(records, greedy=True),
                            records=records)
    out = tmp_path / "r.json"
    res.write_json(out)

    def no_nan(name):
        raise AssertionError(f"{name} in JSON")

    data = json.loads(out.read_text(), parse_constant=no_nan)
    assert set(data) >= {"meta", "rows"} and data["meta"]["threads"] == 1
    for row in data["rows"]:
        assert REQUIRED <= row.keys()
    table = format_table(res)
    assert "autospec:2" in table and "1 threads" in table and "float32" in table
    widths = {len(line) for line in table.splitlines()[2:5]}  # fixed-width data lines
    assert len(widths) == 1


# -- prompts, k lists, modes -------------------------------------------------------------
def test_default_prompts_file_ships_with_the_package():
    prompts = bench.load_prompts(bench.default_prompts_path())
    cats = [p.category for p in prompts]
    assert {c: cats.count(c) for c in set(cats)} == {"code": 2, "chat": 2, "translation": 2}


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"category": "x"}', "'prompt' must be a non-empty string"),
    ('{"category": "", "prompt": "p"}', "'category' must be a non-empty string"),
    ('{"category": "x", "prompt": "p", "chat": "yes"}', "'chat' must be true or false"),
    ('{"category": "x", "prompt": "p", "role": "user"}', "unknown keys ['role']"),
    ('{"category": "overall", "prompt": "p"}', "reserved"),
])
def test_prompt_file_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"category": "code", "prompt": "ok"}\n\n' + line + "\n")
    with pytest.raises(PromptFileError, match=r"p\.jsonl:3: ") as err:
        bench.load_prompts(path)
    assert message in str(err.value)


def test_prompt_file_missing_or_empty(tmp_path):
    with pytest.raises(PromptFileError, match="cannot read"):
        bench.load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PromptFileError, match="no prompts"):
        bench.load_prompts(tmp_path / "empty.jsonl")


def test_k_lists_and_modes():
    assert bench.parse_ks("4, 1,2,4") == [1, 2, 4]
    for bad in ("1,x", "", "0,2", "65"):
        with pytest.raises(ValueError):
            bench.parse_ks(bad)
    names = [m.name for m in bench.parse_modes(["hf-assisted", "hf-assisted:k", "autospec:k",
                                                "autospec:0"], [2, 4])]
    assert names == ["plain", "hf-assisted", "hf-assisted:2", "hf-assisted:4", "autospec:2",
                     "autospec:4", "autospec:0"]
    for bad in ("medusa", "autospec", "hf-assisted:0", "autospec:x"):
        with pytest.raises(ValueError):
            bench.parse_modes([bad], [2])


# -- the command line --------------------------------------------------------------------
def test_help_runs_without_loading_torch():
    code = ("import sys; from autospec.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported for --help'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "bench" in done.stdout and "generate" in done.stdout


@pytest.mark.parametrize("command", ["bench", "generate", "demo"])
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "--threads" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--k", "1,x"], "--k: expected comma-separated integers"),
    (["bench", "--modes", "turbo"], "--modes: unknown mode"),
    (["bench", "--prompts", "{missing}"], "cannot read prompts file"),
    (["generate", "--prompt", "x", "--target", "t"], "--target and --draft go together"),
    (["generate", "--prompt", "x", "--k", "-1"], "must be in 0..64"),
    (["generate", "--prompt", "x", "--temperature", "0.5"], "apply only with --sample"),
    (["generate", "--prompt", "x", "--sample", "--top-p", "1.5"], "must be in (0, 1]"),
])
def test_user_errors_are_messages_not_tracebacks(argv, message, capsys, tmp_path):
    argv = [a.replace("{missing}", str(tmp_path / "none.jsonl")) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.fixture(scope="module")
def saved_pair(models, tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    for name, model in zip(("target", "draft"), models, strict=True):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def test_cli_generate_end_to_end(saved_pair, capsys):
    target, draft = saved_pair
    code = main(["generate", "--target", target, "--draft", draft, "--prompt", "def add(a, b):",
                 "--max-new-tokens", "8", "--k", "3", "--dtype", "fp32", "--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.strip()
    assert "[autospec]" in err and "k=3" in err and "1 threads" in err


def test_cli_generate_chat_streaming_and_sampling(saved_pair, capsys):
    target, draft = saved_pair
    code = main(["generate", "--target", target, "--draft", draft, "--prompt", "hi", "--chat",
                 "--stream", "--sample", "--temperature", "0.7", "--seed", "3",
                 "--max-new-tokens", "6", "--dtype", "fp32", "--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() and "new tokens" in err


def test_cli_bench_end_to_end_writes_json(saved_pair, tmp_path, capsys):
    target, draft = saved_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": c, "prompt": p, "chat": ch})
                                 for c, p, ch in [("code", "def f(x):", False),
                                                  ("chat", "Say hi.", True)]))
    out_json = tmp_path / "out.json"
    code = main(["bench", "--target", target, "--draft", draft, "--prompts", str(prompts),
                 "--k", "2", "--repeats", "1", "--max-new-tokens", "6", "--modes", "autospec:k",
                 "--json", str(out_json), "--dtype", "fp32", "--threads", "1"])
    assert code == 0
    table = capsys.readouterr().out
    assert "autospec:2" in table and "overall" in table and "1 threads" in table
    data = json.loads(out_json.read_text())
    assert data["meta"]["dtype"] == "float32" and data["meta"]["modes"] == ["plain", "autospec:2"]
    assert {r["category"] for r in data["rows"]} == {"code", "chat", "overall"}
    assert all(REQUIRED <= r.keys() for r in data["rows"])


def test_cli_demo_runs_on_a_stand_in_pair(models, tok, monkeypatch, capsys):
    from autospec import pairs as model_loading

    def fake_load_pair(name, **kwargs):  # the real pair is a 1.5 GB download
        target, draft = (copy.deepcopy(m) for m in models)  # the demo wraps the target
        return model_loading.LoadedPair(target=target, draft=draft, tokenizer=tok, name=name)

    monkeypatch.setattr(model_loading, "load_pair", fake_load_pair)
    import autospec

    made, wrap = [], autospec.wrap  # the demo's controller, to see what it learned
    monkeypatch.setattr(autospec, "wrap", lambda *a, **kw: made.append(wrap(*a, **kw)) or made[-1])
    code = main(["demo", "--max-new-tokens", "6", "--k", "2", "--dtype", "fp32", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert {"code", "chat", "translation"} <= set(made[0].live)  # each prompt its category
    for heading in ("=== code", "=== chat", "=== translation"):
        assert heading in out
    assert "2 rounds per prompt" in out and out.count("(median of 2)") == 6
    # per prompt a speedup over the rounds' pairs, or the note that plain runs scattered
    verdicts = [ln.split("->")[1] for ln in out.splitlines() if ln.startswith("--- plain:")]
    assert len(verdicts) == 3 and all(v.strip().startswith(("speedup ", "no speedup stated"))
                                      for v in verdicts)
    if "no speedup stated" in out:  # plain runs that scatter are named in the closing note
        assert "Note: the machine was busy" in out
    assert out.count("identical to plain: yes") == 3 and "1 threads" in out
    assert out.rstrip().splitlines()[-1].startswith("For a real measurement: autospec bench")
    with pytest.raises(SystemExit) as refused:  # one pair is no median
        main(["demo", "--rounds", "1"])
    assert refused.value.code == 2 and "must be in 2..100" in capsys.readouterr().err


def test_demo_explains_every_round_that_differs(models):
    """An earlier round that differed is explained too, not only the last one."""
    from autospec.cli.demo import divergences

    target = models[0]
    ids = torch.randint(4, 60, (1, 6), generator=torch.Generator().manual_seed(0))
    plain = torch.tensor([5, 6, 7, 8])
    differs = torch.tensor([5, 6, 9, 8])
    lines = divergences(target, ids, plain, [(differs, 1.0), (plain, 1.0)],
                        [(plain, 1.0), (plain, 1.0)], torch.float32)
    assert len(lines) == 1 and lines[0].startswith("autospec, round 1: they part at new token 2")
    assert divergences(target, ids, plain, [(plain, 1.0)] * 2, [(plain, 1.0)] * 2,
                       torch.float32) == []


def test_demo_counts_its_own_threads_in_the_load(models, tok, monkeypatch, capsys):
    """On the CPU the demo's own threads are load it makes: a load average of about them
    is no busy machine, one beyond them by half the cores is."""
    import os

    from autospec import pairs as model_loading
    from autospec.cli import demo

    def fake_load_pair(name, **kwargs):
        target, draft = (copy.deepcopy(m) for m in models)
        return model_loading.LoadedPair(target=target, draft=draft, tokenizer=tok, name=name)

    monkeypatch.setattr(model_loading, "load_pair", fake_load_pair)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for load, busy in ((1.9, False), (3.5, True)):
        monkeypatch.setattr(demo, "_load", lambda load=load: load)
        args = ["demo", "--max-new-tokens", "4", "--k", "2", "--dtype", "fp32", "--threads", "2"]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert ("load average 3.5 on 2 cores with 2 threads of its own" in out) is busy
        assert ("load average" in out) is busy


def test_demo_says_when_the_machine_was_busy():
    """The demo's judgement, from what it measured: medians of paired speedups, plain runs'
    scatter across rounds, the load beyond its own threads, the cost model's own timings."""
    from autospec.cli.demo import busy_note, paired_speedups, plain_scatter

    steady = [([0] * 64, 16.0), ([0] * 64, 16.4)]
    assert plain_scatter(steady) < 0.15
    assert plain_scatter([([0] * 64, 16.0), ([0] * 64, 30.0)]) > 0.5
    spec = [([0] * 64, 12.0), ([0] * 64, 12.0)]
    assert paired_speedups(steady, spec) == pytest.approx([16 / 12, 16.4 / 12])
    assert busy_note(0.3, 2.1, 2, 2, [], []) is None  # the demo's own two threads
    assert "load average 3.5 on 2 cores" in busy_note(0.4, 3.5, 2, 2, [], [])
    assert "plain runs scattered across rounds (chat)" in busy_note(None, None, 2, 2, ["chat"], [])
    assert "cost model's timings scattered (code)" in busy_note(0.1, 0.1, 2, 2, [], ["code"])


def test_divergence_reports_position_and_the_targets_margin(models, tok):
    target, draft = models
    runner = bench._Runner(target, draft, tok, draft_tokenizer=None,
                           modes=bench.parse_modes(["autospec:2"], [2]), sample=False, sampling={})
    ids = bench.encode_prompt(tok, PROMPTS[0])
    plain = runner.run(bench.Mode("plain"), ids, 6, 0)["tokens"]
    other = plain[:2] + [(plain[2] + 1) % len(tok)] + plain[3:]
    records = [rec("plain", 0, 0, 1.0, tokens=plain), rec("autospec:2", 0, 0, 1.0, tokens=other)]
    bench._explain_divergences(records, [ids], runner)
    d = records[1].divergence
    assert (d["position"], d["plain_token"], d["token"]) == (2, plain[2], other[2])
    with torch.no_grad():  # the margin is the target's top-2 gap after prompt + plain[:2]
        x = torch.cat([ids, torch.tensor([plain[:2]])], dim=1)
        top = target(input_ids=x).logits[0, -1].topk(2).values
    assert d["margin"] == pytest.approx(float(top[0] - top[1]), rel=1e-4)
    assert records[0].divergence is None
    res = bench.BenchResult(meta={"target": "t", "draft": "d", "device": "cpu", "dtype": "f",
                                  "threads": 1, "prompts": 1, "repeats": 1, "max_new_tokens": 6,
                                  "sample": False},
                            rows=bench.aggregate(records, greedy=True), records=records)
    assert "diverged: code autospec:2 prompt 0 repeat 0 at new token 2" in format_table(res)


# -- the n-gram proposer's modes ----------------------------------------------------------
COPY = [Prompt("copy", "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", False),
        Prompt("copy", "the cat sat on the mat. the cat sat on", False)]


def test_ngram_and_hf_lookup_modes_run_identical_and_count_their_own_drafts(models, tok):
    target, draft = models
    res = bench.run_bench(target, draft, tok, COPY, ks=[3],
                          modes=["hf-lookup:k", "ngram:k", "autospec:k", "policy:hybrid:3:1"],
                          max_new_tokens=16, repeats=1, warmup=False, progress=False)
    rows = {r["mode"]: r for r in res.rows if r["category"] == "overall"}
    assert set(rows) == {"plain", "hf-lookup:3", "ngram:3", "autospec:3", "policy:hybrid:3:1"}
    assert all(r["identical"] is True for r in rows.values())
    ng = rows["ngram:3"]
    assert ng["acceptance"] is not None and 0.0 <= ng["acceptance"] <= 1.0
    assert 1.0 <= ng["tokens_per_forward"] <= 4.0
    assert 1.0 <= rows["hf-lookup:3"]["tokens_per_forward"] <= 4.0
    assert rows["autospec:3"]["lookups"] == {}  # the draft model alone
    assert rows["policy:hybrid:3:1"]["lookups"]["ngram"]["drafted"]  # the hybrid used the n-gram
    # the draft model's oracle is not fed the n-gram's acceptance
    only_ngram = [r for r in res.records if r.mode == "ngram:3"]
    from autospec.bench.stats import oracle

    assert oracle(only_ngram) is None


def test_bench_without_a_draft_model_reports_what_needs_one(saved_pair, tmp_path, capsys):
    target, _ = saved_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": "copy", "prompt": p.prompt,
                                             "chat": False}) for p in COPY))
    out_json = tmp_path / "out.json"
    code = main(["bench", "--target", target, "--draft", "none", "--prompts", str(prompts),
                 "--k", "3", "--repeats", "1", "--max-new-tokens", "8", "--modes", "ngram:k",
                 "autospec:k", "hf-assisted", "policy:auto", "--json", str(out_json),
                 "--dtype", "fp32", "--threads", "1"])
    assert code == 0
    data = json.loads(out_json.read_text())
    modes = {r["mode"] for r in data["rows"]}
    assert {"plain", "ngram:3", "policy:auto"} <= modes and "autospec:3" not in modes
    (one,) = data["batches"]  # batch 1's summary: every mode, run or not
    unsupported = {r["mode"]: r["reason"] for r in one["rows"] if r["status"] == "unsupported"}
    assert "no draft model" in unsupported["autospec:3"]
    assert "no draft model" in unsupported["hf-assisted"]
    out = capsys.readouterr().out
    assert "not run: autospec:3 (no draft model" in out
    assert all(r["identical"] is True for r in data["rows"])
    assert data["meta"]["draft"] == "none (n-gram)"
    # the table shows the n-gram's acceptance of a policy mode (it drafts by n-gram alone)
    auto = next(r for r in data["rows"] if r["mode"] == "policy:auto"
                and r["category"] == "overall")
    ngram = auto["lookups"]["ngram"]["acceptance"]
    assert ngram is not None
    assert "ngram a" in next(line for line in out.splitlines() if line.startswith("category"))
    line = next(line for line in out.splitlines() if line.startswith("overall")
                and "policy:auto" in line)
    assert f"{ngram:.3f}" in line.split()


def test_cli_generate_without_a_draft_model(saved_pair, capsys):
    target, _ = saved_pair
    code = main(["generate", "--target", target, "--draft", "none", "--prompt",
                 "the cat sat on the mat. the cat sat on", "--max-new-tokens", "8", "--k", "3",
                 "--dtype", "fp32", "--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() and "prompt lookup (no draft model)" in err


def test_demo_line_counts_the_n_gram_apart_from_the_draft_model():
    from autospec.cli.demo import _drafting_summary
    from autospec.engine.stats import LoopStats, ProposerCounts

    st = LoopStats(prompt_tokens=4, k_schedule=[2, 9, 2, 0], accepted_schedule=[1, 6, 2, 0],
                   proposer_schedule=["draft", "ngram", "draft", None], model="draft",
                   proposers=("draft", "ngram"))
    for who, k, m in zip(st.proposer_schedule, st.k_schedule, st.accepted_schedule):
        if who is not None:
            st.count_block(who, k, m)
    assert (st.drafts, st.drafted, st.accepted) == (2, 4, 3)
    line = _drafting_summary(st)
    assert line.startswith("acceptance 0.75, mean accepted length 2.50, k used 0×1, 2×2;")
    assert line.endswith("ngram: 1 blocks, acceptance 0.67")
    # prompt lookup opened but never drafted: not shown, and every block is the model's
    st.counts["ngram"] = ProposerCounts()
    st.proposer_schedule = ["draft", "draft", "draft", None]
    assert "ngram" not in _drafting_summary(st) and "9×1" in _drafting_summary(st)


# -- the suffix proposer's modes ------------------------------------------------------------
def test_suffix_mode_runs_identical_and_each_pass_starts_with_an_empty_memory(models, tok):
    """Two identical requests in one pass: the second finds the first's output in the
    category's memory. A new pass starts empty, so its first request finds nothing."""
    target, draft = models
    same = [Prompt("tools", "call the api with", False)] * 2
    res = bench.run_bench(target, draft, tok, same, ks=[4], modes=["suffix:k", "ngram:k"],
                          max_new_tokens=16, repeats=2, warmup=True, progress=False)
    rows = {r["mode"]: r for r in res.rows if r["category"] == "overall"}
    assert rows["suffix:4"]["identical"] is True
    runs = {(r.repeat, r.prompt_index): r for r in res.records if r.mode == "suffix:4"}
    for rep in (0, 1):
        first, second = runs[(rep, 0)], runs[(rep, 1)]
        assert second.accepted == second.drafted >= 12  # its own earlier output, proposed
        assert first.target_forwards > 2 * second.target_forwards
    from autospec.bench.run import parse_modes

    assert [m.name for m in parse_modes(["suffix:k"], [2, 3])] == ["plain", "suffix:2",
                                                                    "suffix:3"]


def test_the_repetitive_prompt_sets_ship_with_the_package():
    from importlib import resources

    for name, per_category in (("repeat.jsonl", 12), ("repeat_holdout.jsonl", 4)):
        prompts = bench.load_prompts(resources.files("autospec") / "prompts" / name)
        cats = [p.category for p in prompts]
        assert {c: cats.count(c) for c in set(cats)} == {
            "sql": per_category, "tool-call": per_category, "support-reply": per_category}


def test_each_autospec_mode_is_measured_against_perfect_foresight(models, tok):
    """The foresight column: every greedy autospec record's least time under perfect foresight
    over the proposers its mode may use (its own traces, this run's forwards) ÷ its time; a
    mode's row holds the median. A fixed k's foresight uses the draft model alone, a lookup's
    its lookup alone; plain and sampled runs have none."""
    from autospec.oracle import Prices, least_seconds

    target, draft = models
    res = bench.run_bench(target, draft, tok, COPY + PROMPTS[:2], ks=[3],
                          modes=["autospec:k", "ngram:k", "policy:auto", "suffix:k"],
                          max_new_tokens=16, repeats=1, warmup=False, progress=False)
    # suffix decoding records its trace only for a store: a mode that may use it has none
    assert all(r.foresight is None for r in res.records if r.mode == "suffix:3")
    spec = [r for r in res.records if r.mode not in ("plain", "suffix:3")]
    assert spec and all(r.foresight is not None and r.foresight > 0 for r in spec)
    assert all(r.foresight is None for r in res.records if r.mode == "plain")
    fixed = next(r for r in spec if r.mode == "autospec:3")
    assert set(fixed.seen["traces"]) >= {"draft", "ngram"}
    assert all(r.foresight < 1.5 for r in spec)  # priced by pooled forwards: near, not past
    # recomputed by hand: the draft model alone, at this run's pooled prices
    prices = Prices.of(type("F", (), {"target_s_by_n": r.seen["target_s_by_n"],
                                      "draft_s": r.seen["draft_s"],
                                      "draft_forwards": r.seen["draft_forwards"]})()
                       for r in res.records if r.seen is not None)  # every mode's forwards
    want = fixed.seen["prefill_s"] + least_seconds(fixed.new_tokens, fixed.seen["traces"],
                                                   {"draft"}, prices, model=fixed.seen["model"])
    assert fixed.foresight == pytest.approx(want / fixed.wall_s)
    # its choices: the same least time over the schedule it ran at those prices — every
    # target forward after the prefill at its width's price, every draft forward at T_d
    ran = fixed.seen["prefill_s"] + sum(len(v) * prices(n) for n, v in
                                        fixed.seen["target_s_by_n"].items())
    ran += fixed.seen["draft_forwards"] * prices.t_draft
    assert fixed.seen["lookup_blocks"] == 0 and fixed.choices == pytest.approx(want / ran)
    assert 0 < fixed.choices <= 1 + 1e-9  # its own schedule is one perfect foresight weighed
    auto = [r for r in spec if r.mode == "policy:auto"]
    assert all(r.choices is not None for r in auto)
    rows = {(r["category"], r["mode"]): r for r in res.rows}
    assert rows[("copy", "ngram:3")]["foresight"] is not None
    assert rows[("overall", "plain")]["foresight"] is None
    assert rows[("overall", "policy:auto")]["foresight"] is not None
    assert rows[("overall", "autospec:3")]["choices"] is not None
    assert "foresight" in format_table(res) and "choices" in format_table(res)
    runs = res.to_json()["runs"]
    assert "seen" not in json.dumps(runs) and all("foresight" in r for r in runs)
