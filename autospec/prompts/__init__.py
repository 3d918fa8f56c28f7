"""Data: the default benchmark prompts (default.jsonl)."""
