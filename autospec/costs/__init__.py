"""What verification and drafting cost: the cost table every reader prices from (``table``:
per execution path and batch size; ``row``, ``rules``), the batch cost grid and the costs
every reader builds from the store (``grid``, ``stored.stored_costs``). Torch-free; the probe
that measures them on this hardware is ``autospec.probe``."""

# a live cost point — T_t(n), T_d at batch 1, T_t(B, n) or T_d(B) — counts only with this many
# forwards behind it (a handful of slow forwards bends a curve); the one definition, which the
# store's queries and every reader of costs use
MIN_FORWARDS = 16
