"""The speculative engine: one iteration (propose → verify → accept → account → emit) for
every batch size, the KV slot cache it runs on, its proposers, and how a forward runs."""
