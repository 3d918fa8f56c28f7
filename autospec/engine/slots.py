"""One model's KV cache as B rows of S slots: append with positions, mask rejected slots,
select rows, repack.

A slot holds a token of its row, left padding, or a draft token the row rejected. A validity
mask over the slots ([B, S], 1 = a token of the row's sequence) hides the last two, and every
token is fed with its own position id, so a row's attention sees exactly its sequence, in
order, at the right positions, whatever its neighbours accepted. Rows that feed fewer tokens
than others in one forward (a catch-up of one token beside one of two) are right-aligned,
padded on the left within the block.

A row whose slots are all its own tokens, in order, from slot 0 ("contiguous": always at
batch 1, where rejected drafts are cropped rather than masked) is fed without a mask or
position ids, as ``generate`` feeds it; a static runner (batch 1) serves exactly that case.

Where rows have holes or padding the engine builds the attention masks itself, from each
slot's position and validity (one per layer type: a sliding window spans a row's tokens,
never its holes, where the models' own masks would count slots), on the device:
transformers' mask code would read the padding mask on the host at every forward.

Memory bound: masked slots grow by at most k per row per iteration; whenever the slots exceed
the longest row's tokens by more than ``max(SLACK, S // 4)``, each row's valid slots are
gathered to the right (one copy of the cache), so a cache holds at most about
1.25 × (longest prompt + tokens generated) + SLACK + k + 1 slots per row.
"""

from __future__ import annotations

import functools

import torch

from autospec.engine.checks import Layout

__all__ = ["SlotCache", "SLACK", "MASKS_4D", "kv_bytes_per_token"]

# attention implementations that take the engine's own 4-D masks (built without a host read;
# transformers' own mask code reads the padding mask on the host to decide whether it may
# skip it, once per forward)
MASKS_4D = ("sdpa", "eager")

SLACK = 32  # masked slots tolerated per row before the cache is repacked


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V one cached token occupies across all layers."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * heads * head_dim * elem


class SlotCache:
    """The slots of one model for the rows of one call. Host-side, it knows each row's
    cached token count (``lens``) and the slot after its last valid one (``ends``); on the
    device, the same counts (``lens_dev``), the validity mask and, for sliding windows, each
    slot's position. ``runner``: ``runners.EagerRunner`` (any batch) or ``StaticRunner``
    (batch 1); ``map_ids``: applied to ids before the forward (the draft's ``DraftInput``)."""

    def __init__(self, runner, rows: int, device: torch.device, layout: Layout,
                 map_ids=None, kv_per_token: int = 0):
        self.runner, self.device, self.layout = runner, device, layout
        self.map_ids = map_ids  # None: ids as they are
        self.lens = [0] * rows
        self.ends = [0] * rows
        # the device copy of ``lens``, which only rows that can have holes need (a cache of
        # one row is cropped, never masked: batch 1 keeps its counts on the host alone)
        self.lens_dev = (torch.zeros(rows, dtype=torch.long, device=device) if rows > 1
                         else None)
        self.slots = 0
        self.valid: torch.Tensor | None = None  # [B, S] long; None: every row contiguous
        self.pos: torch.Tensor | None = None  # [B, S] each slot's position (with ``valid``)
        self.kv_per_token = kv_per_token
        self.repacks = 0
        self.peak = 0  # the most slots it held (a row's: batch 1 tracks memory by it)
        self._mark = 0  # slots before the current iteration's appends

    @property
    def rows(self) -> int:
        return len(self.lens)

    @property
    def kv_bytes(self) -> int:
        return self.rows * self.slots * self.kv_per_token

    @property
    def contiguous(self) -> bool:
        return self.valid is None

    def mark(self) -> None:
        """Start an iteration: ``reject`` counts back from the slots appended after this."""
        self._mark = self.slots

    # -- forwards ----------------------------------------------------------------------------
    def feed(self, tokens: torch.Tensor, known: list[int], known_dev: torch.Tensor,
             extra: torch.Tensor | None, keep: int, offset: int = 0, hidden: bool = False):
        """Append, per row, the tokens of its sequence it has not cached yet (``tokens``
        [B, cap] holds each row's sequence; the row has ``known[b] + offset`` of them, and
        ``known_dev`` [B] is ``known`` on the device), then the columns of ``extra`` [B, e]
        at the positions after them. Returns the logits of the last ``keep`` slots,
        [B, keep, V] — with ``hidden`` (the opt-in hook for proposers that draft from the
        target's hidden states; an eager runner's), (logits, the last layer's hidden states
        there [B, keep, d])."""
        run = self.runner.run if not hidden else functools.partial(self.runner.run,
                                                                  hidden=True)
        e = 0 if extra is None else extra.shape[1]
        if self.lens_dev is None:  # one contiguous row: host slices, no mask or positions
            start, end = self.lens[0], known[0] + offset
            if extra is None:
                ids = tokens[:, start:end]
            else:
                ids = extra if start == end else torch.cat([tokens[:, start:end], extra], dim=1)
            self.lens[0] = end + e
            self.slots += end - start + e
            self.ends[0] = self.slots
            if self.slots > self.peak:
                self.peak = self.slots
            return run(ids if self.map_ids is None else self.map_ids(ids), keep)
        width = max(n + offset - c for n, c in zip(known, self.lens))
        upto = known_dev + offset if offset else known_dev
        out = self._feed_slots(tokens, upto, width, extra, keep, run)
        self.lens_dev = upto + e if e else upto
        self.lens = [n + offset + e for n in known]
        self.slots += width + e
        self.ends = [self.slots] * self.rows
        return out

    def _feed_slots(self, tokens, known_dev, width: int, extra, keep: int, run):
        B, dev = self.rows, self.device
        e = 0 if extra is None else extra.shape[1]
        parts_ids, parts_pos, parts_ok = [], [], []
        if width:
            at = known_dev[:, None] - width + torch.arange(width, device=dev)  # [B, w]
            parts_ok.append((at >= self.lens_dev[:, None]).long())
            at = at.clamp_min(0)
            parts_ids.append(tokens.gather(1, at))
            parts_pos.append(at)
        if e:
            parts_ids.append(extra)
            parts_pos.append(known_dev[:, None] + torch.arange(e, device=dev))
            parts_ok.append(torch.ones(B, e, dtype=torch.long, device=dev))
        ids, pos, ok = (torch.cat(p, dim=1) for p in (parts_ids, parts_pos, parts_ok))
        if self.valid is None:  # the first holes or padding: every earlier slot was valid
            self._materialise()
        self.valid = torch.cat([self.valid, ok], dim=1)
        self.pos = torch.cat([self.pos, pos], dim=1)
        mask = (self._masks(pos, ok) if self.layout.attention in MASKS_4D
                else self.valid)  # other kernels take the padding mask (no sliding windows)
        if self.map_ids is not None:
            ids = self.map_ids(ids)
        return run(ids, keep, attention_mask=mask, position_ids=pos)

    def _materialise(self) -> None:
        """Every slot so far valid, at its own index's position (a contiguous past)."""
        self.valid = torch.ones(self.rows, self.slots, dtype=torch.long, device=self.device)
        self.pos = torch.arange(self.slots, device=self.device).expand(self.rows, -1).clone()

    def _masks(self, q_pos: torch.Tensor, q_ok: torch.Tensor):
        """The 4-D masks of one forward from each slot's position: a query attends to the
        valid slots of its row at or before its position (and within the window, for sliding
        layers); a padding query attends to itself alone (its output is never read)."""
        n, S = q_pos.shape[1], self.valid.shape[1]
        kv_pos, kv_ok = self.pos[:, None, :], self.valid.bool()[:, None, :]  # [B, 1, S]
        q = q_pos[:, :, None]  # [B, n, 1]
        own = torch.zeros(n, S, dtype=torch.bool, device=self.device)
        own[:, S - n :] = torch.eye(n, dtype=torch.bool, device=self.device)
        pad_q = ~q_ok.bool()[:, :, None] & own  # [B, n, S]
        full = kv_ok & (kv_pos <= q)
        masks = {"full_attention": full | pad_q}
        if self.layout.window is not None:
            masks["sliding_attention"] = (full & (q - kv_pos < self.layout.window)) | pad_q
        dtype = self.runner.dtype
        for kind, allowed in masks.items():
            allowed = allowed[:, None]  # [B, 1, n, S]
            if self.layout.attention != "sdpa":  # eager attention adds the mask
                allowed = torch.zeros(allowed.shape, dtype=dtype, device=self.device
                                      ).masked_fill(~allowed, torch.finfo(dtype).min)
            masks[kind] = allowed
        if self.layout.by_type:
            return masks
        return masks["sliding_attention" if self.layout.window is not None else "full_attention"]

    # -- after verification ------------------------------------------------------------------
    def reject(self, drop: list[int], drop_dev) -> None:
        """Row b's last ``drop[b]`` slots appended since ``mark`` were rejected: the tail
        every row rejected is cropped, the rest masked (``drop_dev()``: the same on the
        device, asked for only where rows can have holes)."""
        if self.lens_dev is None:  # one contiguous row: a crop
            if drop[0]:
                self.slots -= drop[0]
                self.runner.crop(self.slots)
                self.lens[0] -= drop[0]
                self.ends[0] = self.slots
            return
        common = min(drop)
        if self.lens_dev is not None:
            drop_dev = drop_dev()
        if common:
            self.runner.crop(self.slots - common)
            self.slots -= common
            if self.valid is not None:
                self.valid, self.pos = self.valid[:, : self.slots], self.pos[:, : self.slots]
        rest = max(drop) - common
        if rest:
            if self.valid is None:
                self._materialise()
            cols = torch.arange(rest, device=self.device)
            self.valid[:, self.slots - rest :] *= (cols < rest - (drop_dev - common)[:, None])
        self.lens = [n - d for n, d in zip(self.lens, drop)]
        if self.lens_dev is not None:
            self.lens_dev = self.lens_dev - drop_dev
        self.ends = [self.slots - (d - common) for d in drop]

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep only these rows (``index``: the same on the device)."""
        cache = self.runner.cache
        cache.batch_select_indices(index)
        self.lens = [self.lens[b] for b in keep]
        self.ends = [self.ends[b] for b in keep]
        self.lens_dev = self.lens_dev[index]
        if self.valid is not None:
            self.valid, self.pos = self.valid[index], self.pos[index]

    def compact(self) -> None:
        """Cut trailing slots no row uses; repack when masked slots pile up."""
        end = max(self.ends)
        if end < self.slots:
            self.runner.crop(end)
            self.slots = end
            if self.valid is not None:
                self.valid, self.pos = self.valid[:, :end], self.pos[:, :end]
        longest = max(self.lens)
        if self.valid is None or self.slots - longest <= max(SLACK, self.slots // 4):
            return
        # gather each row's valid slots to the right: every row's tokens end at `longest`
        S = self.slots
        order = torch.arange(S, device=self.device).expand(self.rows, S)
        ok = self.valid.bool()
        key = torch.where(ok, order + S, order)  # valid slots sort after the holes
        gather = key.argsort(dim=1, stable=True)[:, S - longest :]  # [B, longest]
        for layer in self.runner.cache.layers:
            keys = layer.keys
            if keys is None or keys.dim() != 4 or keys.shape[-2] != S:
                raise RuntimeError(f"a cache layer of shape {None if keys is None else tuple(keys.shape)} "
                                   f"in a slot cache of {S} slots: the engine cannot repack it")
            g = gather[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            layer.keys = keys.gather(2, g)
            layer.values = layer.values.gather(2, g)
        self.valid = ok.gather(1, gather).long()
        self.pos = self.pos.gather(1, gather)
        self.slots = longest
        self.ends = [longest] * self.rows
        self.repacks += 1

    def release(self) -> None:
        self.runner.release()
