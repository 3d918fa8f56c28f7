"""Run by the vLLM environment's interpreter (``autospec.fleet.check``), never imported by
autospec: standard library and vLLM only.

    python _vllm_check.py JOBS.json RESULTS.json

Each job: ``{"target": DIR or null, "speculative_config": {...}, "max_model_len": N}``.
vLLM's own code judges it: ``EngineArgs(model=…, speculative_config=…)
.create_engine_config()`` (the ``SpeculativeConfig`` it builds refuses unknown fields, an
unknown method, ``num_speculative_tokens`` ≤ 0, a lookup min above the max, schedule entries
that are not 3 items), then, for a per-batch-size schedule, the scheduler's own
``build_dynamic_sd_schedule_lookup`` at the engine's ``max_num_seqs`` (it refuses a first range
not starting at 1 and overlapping ranges, which the config alone lets through). No weights are
read. A job without a target (the export names models that are not local directories) runs
against a stand-in pair: two tiny Qwen2 configs and a word-level tokenizer written to a
temporary directory, so the fields are judged but not the models.

Each result: ``{"ok": bool, "error": one line or null, "max_num_seqs": N, "schedule": [...]}``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback


def _one_line(e: BaseException) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):  # pydantic's ValidationError: each error's field and message
        try:
            parts = []
            for err in errors():
                loc = ".".join(str(p) for p in err.get("loc", ()))
                msg = str(err.get("msg", "")).split("\n")[0]
                parts.append(f"{loc}: {msg}" if loc else msg)
            if parts:
                return f"{type(e).__name__}: " + "; ".join(parts)
        except Exception:
            pass
    text = " ".join(str(e).split()) or repr(e)
    return f"{type(e).__name__}: {text[:500]}"


def _stand_in(root: str) -> tuple[str, str]:
    """A tiny target and draft (configs and a tokenizer, no weights) under ``root``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3}
    vocab.update({f"w{i}": i for i in range(4, 96)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   unk_token="<unk>", eos_token="</s>")
    dirs = []
    for name, layers in (("target", 2), ("draft", 1)):
        cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
        path = f"{root}/{name}"
        cfg.save_pretrained(path)
        fast.save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]


def check(job: dict, stand_in: tuple[str, str] | None) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    spec = dict(job["speculative_config"])
    target = job.get("target")
    if target is None:
        target = stand_in[0]
        if spec.get("method") in (None, "draft_model") and "model" in spec:
            spec["model"] = stand_in[1]
    out = {"ok": False, "error": None, "max_num_seqs": None, "schedule": None}
    try:
        cfg = EngineArgs(model=target, speculative_config=spec, dtype="bfloat16",
                         max_model_len=job.get("max_model_len", 2048)).create_engine_config()
        sc = cfg.speculative_config
        out["max_num_seqs"] = cfg.scheduler_config.max_num_seqs
        if sc is not None and sc.num_speculative_tokens_per_batch_size:
            dense = build_dynamic_sd_schedule_lookup(
                sc.num_speculative_tokens_per_batch_size,
                vllm_max_batch_size=cfg.scheduler_config.max_num_seqs,
                vllm_num_speculative_tokens=sc.num_speculative_tokens)
            out["schedule"] = dense[1:]
        out["ok"] = True
    except Exception as e:  # vLLM's refusal, in its words
        out["error"] = _one_line(e)
        out["trace"] = traceback.format_exc(limit=3)
    return out


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        jobs = json.load(f)
    with tempfile.TemporaryDirectory(prefix="autospec-vllm-check-") as root:
        stand_in = _stand_in(root) if any(j.get("target") is None for j in jobs) else None
        results = [check(job, stand_in) for job in jobs]
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
