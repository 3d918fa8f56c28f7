"""What verification and drafting cost on this hardware: the probe, the cost grid and the
costs every reader builds from the store (``stored.stored_costs``)."""

# a live cost point — T_t(n), T_d at batch 1, T_t(B, n) or T_d(B) — counts only with this many
# forwards behind it (a handful of slow forwards bends a curve); the one definition, which the
# store's queries and every reader of costs use
MIN_FORWARDS = 16
