"""The engine's KV memory: one fixed pool of pages shared by every request.

The pool holds `num_pages * page_size` token slots per layer (target layers and
the head's layer alike) plus one trash slot. A request owns a list of pages;
its position p lives at slot `pages[p // page_size] * page_size + p % page_size`.
A batched forward gathers each row's slots into a padded (B, nkv, S, hd) view
and masks by position, so requests of any lengths share one forward:

    row b, query t at position pos_b + t  sees key positions 0 .. pos_b + t

Rows are ragged at their ends only (padding after the valid tokens), so the
causal mask alone keeps padding out of every valid query; padded tokens write
to the trash slot. A shorter row's read table is filled up with the trash slot
too: those keys are gathered and masked out (the trash holds finite values, so
masked keys contribute exactly zero).

Budget: `PagePool.admit` reserves a request's worst case (prompt + max_tokens +
the largest draft + 1 positions) before it runs, so a running request never
waits for memory or gets preempted; `PagePool.grow` then allocates pages as
positions are written (all-or-nothing per request and round), and `release`
returns them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..decoding.drafting import EagerDrafting
from ..decoding.layout import Layout
from ..decoding.runner import region_mask
from ..decoding.types import SequenceState
from ..errors import Eagle3Error
from ..targets.cache import masked_attention, slots_upto


class PagePool:
    """Page allocation and per-request page tables (host side, no tensors of K/V)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise Eagle3Error(f"the KV pool needs at least one page (got {num_pages} pages of {page_size})")
        self.num_pages, self.page_size = num_pages, page_size
        self.trash = num_pages * page_size  # the extra slot padding writes to
        self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self.reserved = 0  # pages promised to admitted requests (allocated or not)
        self.pages: dict[str, list[int]] = {}
        self.slots: dict[str, torch.Tensor] = {}  # request -> (n_pages * page_size,) slot ids
        self.promised: dict[str, int] = {}
        self.version = 0  # bumped whenever a page table changes (read tables built before are stale)

    def pages_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page_size)

    def can_admit(self, n_positions: int) -> bool:
        return self.reserved + self.pages_for(n_positions) <= self.num_pages

    def admit(self, rid: str, n_positions: int) -> None:
        """Reserve room for `n_positions` positions of request `rid` (its worst case)."""
        need = self.pages_for(n_positions)
        if self.reserved + need > self.num_pages:
            raise Eagle3Error(f"the KV pool has {self.num_pages - self.reserved} free pages; "
                              f"request {rid} needs {need}")
        self.reserved += need
        self.promised[rid] = need
        self.pages[rid] = []
        self.slots[rid] = torch.empty(0, dtype=torch.long)

    def grow(self, rid: str, n_positions: int) -> None:
        """Make positions 0..n_positions-1 of `rid` writable (allocates whole pages, or none)."""
        pages = self.pages[rid]
        need = self.pages_for(n_positions) - len(pages)
        if need <= 0:
            return
        if len(pages) + need > self.promised[rid]:
            raise Eagle3Error(f"request {rid} outgrew its KV reservation ({self.promised[rid]} pages)")
        if need > len(self.free):  # cannot happen while reservations are honoured
            raise Eagle3Error(f"the KV pool has {len(self.free)} free pages; request {rid} needs {need}")
        new = [self.free.pop() for _ in range(need)]
        pages.extend(new)
        self.version += 1
        ps = self.page_size
        fresh = (torch.tensor(new)[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)
        self.slots[rid] = torch.cat([self.slots[rid], fresh])

    def release(self, rid: str) -> None:
        """Return every page `rid` holds or was promised (idempotent)."""
        if rid not in self.pages:
            return
        self.free.extend(reversed(self.pages.pop(rid)))
        self.version += 1
        self.reserved -= self.promised.pop(rid)
        del self.slots[rid]

    @property
    def used_tokens(self) -> int:
        return (self.num_pages - len(self.free)) * self.page_size

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size


class PagedKV:
    """K/V slots for `n_layers` layers of one model: `k[layer]` is (num_slots + 1, nkv, hd).

    The model's attention calls `update(layer, write_slots, k, v)` (through
    `cached_attention`) and gets back the keys and values of the rows prepared by
    `prepare` for this forward.
    """

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu", exact: bool = False) -> None:
        self.exact = exact  # row-invariant attention (see `cache.masked_attention`)
        shape = (n_slots + 1, n_kv_heads, head_dim)  # + the trash slot
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.read_slots: torch.Tensor | None = None  # (B, S), set per forward
        self.read_start: int | None = None  # one row whose slots are consecutive: its first
        self._gathered: list[torch.Tensor | None] = [None, None]  # K, V rows: `_gather`'s buffers

    def prepare(self, read_slots: torch.Tensor, start: int | None = None) -> None:
        """The rows' slots for this forward; `start` when one row reads consecutive slots
        start..start+S-1, which are then a view rather than a gathered copy."""
        self.read_slots, self.read_start = read_slots, start

    def update(self, layer: int, write_slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hd) at `write_slots` (B, T); return the rows' K, V (B, nkv, S, hd)."""
        B, nkv, T, hd = k.shape
        flat = write_slots.reshape(-1)
        dt = self.k[layer].dtype  # a bf16 pool rounds each element alone, as the static cache does
        self.k[layer].index_copy_(0, flat, k.transpose(1, 2).reshape(B * T, nkv, hd).to(dt))
        self.v[layer].index_copy_(0, flat, v.transpose(1, 2).reshape(B * T, nkv, hd).to(dt))
        read = self.read_slots
        S = read.shape[1]
        if self.read_start is not None:  # no copy: the row's K/V are one slice of the pool
            s0 = self.read_start
            return (self.k[layer][s0:s0 + S].view(1, S, nkv, hd).transpose(1, 2),
                    self.v[layer][s0:s0 + S].view(1, S, nkv, hd).transpose(1, 2))
        keys = self._gather(0, self.k[layer], read.reshape(-1)).view(B, S, nkv, hd).transpose(1, 2)
        values = self._gather(1, self.v[layer], read.reshape(-1)).view(B, S, nkv, hd).transpose(1, 2)
        return keys, values

    def _gather(self, which: int, pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """`pool`'s rows at `idx`, into a buffer every layer and step reuses (a layer's keys are
        read before the next layer gathers). A fresh tensor each time comes from mmap and faults
        its pages in, which dominated a bf16 regeneration step (docs/training.md)."""
        buf = self._gathered[which]
        n = idx.shape[0]
        if buf is None or buf.shape[0] < n or buf.dtype != pool.dtype or buf.device != pool.device:
            buf = self._gathered[which] = pool.new_empty((n + n // 4 + 256, *pool.shape[1:]))
        return gather_rows(pool, idx, out=buf[:n])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               write_slots: torch.Tensor, mask: torch.Tensor, kv_len: int, scale: float,
               softcap: float | None = None, stock: bool = False) -> torch.Tensor:
        """Write k, v at `write_slots` (B, T); attend q over the prepared rows under `mask`
        (`stock`: SDPA even on a row-invariant cache, for a prompt's forward)."""
        keys, values = self.update(layer, write_slots, k, v)
        return masked_attention(q, keys, values, mask, scale, softcap, self.exact, stock)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots `src` (N,) to slots `dst` (N,)."""
        for layer_kv in (*self.k, *self.v):
            layer_kv.index_copy_(0, dst, gather_rows(layer_kv, src))


def gather_rows(pool: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`pool.index_select(0, idx)` (into `out` when given). A 16-bit pool goes through an int16
    view of the same bytes: PyTorch copies those rows faster than bf16 ones on CPU
    (docs/training.md)."""
    if pool.dtype in (torch.bfloat16, torch.float16) and pool.device.type == "cpu":
        if out is None:
            return pool.view(torch.int16).index_select(0, idx).view(pool.dtype)
        torch.index_select(pool.view(torch.int16), 0, idx, out=out.view(torch.int16))
        return out
    return pool.index_select(0, idx) if out is None else torch.index_select(pool, 0, idx, out=out)


def read_table(pool: PagePool, rids: list[str]) -> torch.Tensor:
    """(B, S) slot ids of positions 0..S-1 per row, S = the longest row's allocation; trash past a row's."""
    slots = [pool.slots[rid] for rid in rids]
    S = max(s.shape[0] for s in slots)
    table = torch.full((len(rids), S), pool.trash, dtype=torch.long)
    for b, s in enumerate(slots):
        table[b, :s.shape[0]] = s
    return table


def place(table: torch.Tensor, trash: int, layout: Layout, T: int,
          device: torch.device) -> tuple[torch.Tensor, ...]:
    """Slots, positions and masks of a `Layout` over rows whose slots are `table` (B, S_alloc).

    Returns write slots (B, T), read slots (B, S), RoPE positions (B, T), the attention
    mask (B, 1, T, S) and the keys' RoPE positions (B, S). A token is valid when
    t < counts[b]; invalid ones write to the trash slot, take position 0 and see
    position 0 (a query that sees nothing would make NaNs that the trash then holds).
    Callers write valid tokens only at positions their row has pages for.
    """
    B = len(layout.starts)
    R = layout.span
    starts = torch.tensor(layout.starts, device=device)[:, None]  # (B, 1)
    S = min(max(layout.starts) + R, table.shape[1])
    read = table[:, :S].to(device)
    pos = starts + layout.offsets[None, :]  # (B, T)
    valid = pos < S
    if layout.counts is not None:
        valid &= slots_upto(T, device)[None, :] < torch.tensor(layout.counts, device=device)[:, None]
    write = read.gather(1, pos.clamp(max=S - 1)).masked_fill(~valid, trash)
    j = slots_upto(S, device)[None, None, :] - starts[:, :, None]  # (B, 1, S): key offset from start
    region = region_mask(layout, T, device)  # (B, T, R)
    in_region = (j >= 0) & (j < R)
    seen = region.gather(2, j.clamp(0, R - 1).expand(B, T, S)) & in_region
    mask = (j < 0) | seen | (~valid[:, :, None] & (j == -starts[:, :, None]))  # (B, T, S)
    rope = starts + (layout.offsets[None, :] if layout.rope is None else layout.rope)
    rp = layout.region_pos if layout.region_pos is not None else slots_upto(R, device)[None].expand(B, R)
    key_pos = torch.where(j[:, 0] < 0, j[:, 0] + starts,
                          starts + rp.gather(1, j[:, 0].clamp(0, R - 1)))  # (B, S)
    return write, read, rope.masked_fill(~valid, 0), mask[:, None], key_pos


class PagedRunner(EagerDrafting):
    """Many sequences over one page pool: the engine's target and draft forwards.

    Sequences are named by their `id`; their pages come from `pool` (`PagePool.grow`
    through `reserve`). Target and head keep their K/V in two `PagedKV`s indexed by the
    same slots.
    """

    def __init__(self, target: Any, draft: Any, taps: tuple[int, ...] | None, pool: PagePool) -> None:
        cfg = target.config
        w = target.embedding_weight
        self.target_model, self.draft_model, self.taps, self.pool = target, draft, taps, pool
        self.max_len = cfg.max_seq_len
        self.device = w.device
        self.has_draft = draft is not None
        self.vocab_size = target.config.vocab_size
        self.tkv = PagedKV(cfg.num_hidden_layers, pool.total_tokens, cfg.num_key_value_heads,
                           cfg.head_dim, dtype=getattr(target, "kv_dtype", None) or w.dtype,
                           device=w.device, exact=getattr(target, "exact", False))
        self.dkv = None
        if draft is not None:
            dc = draft.config
            self.dkv = PagedKV(1, pool.total_tokens, dc.num_key_value_heads, dc.head_dim,
                               dtype=draft.dtype, device=w.device)
        self._table, self._table_key, self._start = None, None, None
        self.supports_trees = True

    def _place(self, seqs: list[Any], layout: Layout, T: int) -> tuple[torch.Tensor, ...]:
        rids = [s.id for s in seqs]
        key = (tuple(rids), self.pool.version)
        if self._table_key != key:  # read tables cached until the rows or their pages change
            self._table, self._table_key = read_table(self.pool, rids), key
            row = self._table[0]
            # One row on consecutive slots (a lone request's pages usually are): read a view.
            self._start = (int(row[0]) if len(rids) == 1 and bool((row.diff() == 1).all())
                           else None)
        return place(self._table, self.pool.trash, layout, T, self.device)

    def target(self, seqs: list[Any], tokens: torch.Tensor, layout: Layout, *,
               with_features: bool = True, last_only: bool = False,
               prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        write, read, rope, mask, key_pos = self._place(seqs, layout, tokens.shape[1])
        self.tkv.prepare(read, self._start)
        return self.target_model.forward_logits_taps(
            tokens, write, self.tkv, attn_mask=mask, rope_pos=rope, key_pos=key_pos,
            key_slots=slots_upto(read.shape[1], self.device), last_only=last_only,
            with_taps=with_features and self.has_draft, taps=self.taps, prefill=prefill)

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        return self.draft_model.fuse(taps)

    def draft(self, seqs: list[Any], tokens: torch.Tensor, features: torch.Tensor,
              layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        write, read, rope, mask, _ = self._place(seqs, layout, tokens.shape[1])
        self.dkv.prepare(read, self._start)
        return self.draft_model(tokens, features, write, self.dkv, attn_mask=mask, rope_pos=rope,
                                key_slots=slots_upto(read.shape[1], self.device))

    def compact(self, seq: Any, src: list[int], dst: int) -> None:
        slots = self.pool.slots[seq.id]
        self.tkv.move(slots[torch.tensor(src)].to(self.device),
                      slots[dst:dst + len(src)].to(self.device))

    @contextmanager
    def probe_rows(self, B: int, positions: int) -> Iterator[list[SequenceState] | None]:
        """B stand-in sequences with pages for `positions` positions (None when the pool is short)."""
        pool = self.pool
        if B * pool.pages_for(positions) > pool.num_pages - pool.reserved:
            yield None
            return
        seqs = [SequenceState(f"probe-{b}", [0], 1, frozenset()) for b in range(B)]
        try:
            for s in seqs:
                pool.admit(s.id, positions)
                pool.grow(s.id, positions)
            yield seqs
        finally:
            for s in seqs:
                pool.release(s.id)

    def reserve(self, seq: Any, n_positions: int) -> None:
        self.pool.grow(seq.id, n_positions)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_model.to_target_ids(draft_ids)

    @property
    def kv_bytes(self) -> int:
        kvs = [self.tkv] + ([self.dkv] if self.dkv is not None else [])
        return sum(t.numel() * t.element_size() for kv in kvs for t in (*kv.k, *kv.v))
