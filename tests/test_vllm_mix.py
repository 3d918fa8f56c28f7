"""``scripts/vllm_mix.py``'s table, on hand-made records (no vLLM): each mode's speedup is paired
per request against plain's, the best fixed setting per category is chosen in hindsight
(plain included), each category's export is served by the fixed mode of the same setting
where there is one, and token identity is judged against plain of the same dtype."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "vllm_mix", Path(__file__).resolve().parents[1] / "scripts" / "vllm_mix.py")
vllm_mix = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(vllm_mix)

DRAFT = "/models/draft"


def _rec(mode, phase, i, category, wall_s, ids=(1, 2, 3, 4)):
    return {"mode": mode, "phase": phase, "i": i, "category": category, "tokens": len(ids),
            "wall_s": wall_s, "ids": list(ids)}


def test_exports_map_onto_the_fixed_modes_of_the_same_setting():
    specs = {"a": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 1},
             "b": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 7},
             "c": None,
             "d": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1},
             "e": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 7}}
    modes = {c: m for c, (m, _) in vllm_mix.exported_modes(specs).items()}
    assert modes == {"a": "draft1", "b": "draft7", "c": "plain", "d": "exported-1",
                     "e": "draft7"}


def test_the_table_pairs_per_request_and_picks_the_best_fixed_setting(tmp_path, capsys):
    recs = []
    # plain: 2 s a request; code: draft1 1 s (2×), ngram5 4 s (0.5×); chat: every mode slower
    for i, cat in enumerate(["code", "code", "chat"]):
        recs.append(_rec("plain", "seq", i, cat, 2.0))
        recs.append(_rec("draft1", "seq", i, cat, 1.0 if cat == "code" else 2.5))
        recs.append(_rec("ngram5", "seq", i, cat, 4.0))
        # autospec: 1.6 s on code, plain's time on chat, one request's output differs at 2
        recs.append(_rec("autospec", "seq", i, cat, 1.6 if cat == "code" else 2.0,
                         ids=(1, 2, 9, 9) if i == 1 else (1, 2, 3, 4)))
    recs += [_rec("plain-fp32", "seq", 0, "code", 4.0), _rec("autospec-fp32", "seq", 0, "code",
                                                                  3.0)]
    (tmp_path / "mix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "exported.json").write_text(json.dumps(
        {"code": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 1},
         "chat": None}))
    vllm_mix.table(tmp_path)
    out = capsys.readouterr().out
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln}
    head = rows.pop("category")
    col = {name: j for j, name in enumerate(head)}
    assert rows["code"][col["draft1"]] == "2.00" and rows["code"][col["ngram5"]] == "0.50"
    assert rows["code"][col["(c) best fixed"]] == "2.00 (draft1)"
    assert rows["chat"][col["(c) best fixed"]] == "1.00 (plain)"  # k = 0 is a fixed k too
    assert rows["code"][col["(d) exported"]] == "2.00 (draft1)"
    assert rows["chat"][col["(d) exported"]] == "1.00 (plain)"
    assert rows["code"][col["autospec"]] == "1.25"
    assert "- autospec: 2/3 (at [2])" in out
    assert "- autospec-fp32: 1/1;" in out  # against plain in float32, not bf16's plain
    assert "(d) over (c) on the mix: 1.00" in out
    assert (tmp_path / "table.md").read_text().strip() == out.strip()
