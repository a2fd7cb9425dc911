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

import torch

from ..errors import Eagle3Error
from ..targets.decoder import slots_upto


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
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (n_slots + 1, n_kv_heads, head_dim)  # + the trash slot
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.read_slots: torch.Tensor | None = None  # (B, S), set per forward

    def prepare(self, read_slots: torch.Tensor) -> None:
        self.read_slots = read_slots

    def update(self, layer: int, write_slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hd) at `write_slots` (B, T); return the rows' K, V (B, nkv, S, hd)."""
        B, nkv, T, hd = k.shape
        flat = write_slots.reshape(-1)
        self.k[layer].index_copy_(0, flat, k.transpose(1, 2).reshape(B * T, nkv, hd))
        self.v[layer].index_copy_(0, flat, v.transpose(1, 2).reshape(B * T, nkv, hd))
        read = self.read_slots
        S = read.shape[1]
        keys = self.k[layer].index_select(0, read.reshape(-1)).view(B, S, nkv, hd).transpose(1, 2)
        values = self.v[layer].index_select(0, read.reshape(-1)).view(B, S, nkv, hd).transpose(1, 2)
        return keys, values


def read_table(pool: PagePool, rids: list[str]) -> torch.Tensor:
    """(B, S) slot ids of positions 0..S-1 per row, S = the longest row's allocation; trash past a row's."""
    slots = [pool.slots[rid] for rid in rids]
    S = max(s.shape[0] for s in slots)
    table = torch.full((len(rids), S), pool.trash, dtype=torch.long)
    for b, s in enumerate(slots):
        table[b, :s.shape[0]] = s
    return table


def batch_layout(table: torch.Tensor, trash: int, starts: list[int], counts: list[int] | None, T: int,
                 max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots, positions and mask for rows writing `counts[b]` valid tokens (of T) at `starts[b]`.

    `table` is `read_table` of the rows. Returns write_slots (B, T), read_slots (B, S),
    rope positions (B, T) and the attention mask (B, 1, T, S). A token is valid when
    t < counts[b] and its position < S (the longest allocation, < max_len); invalid ones
    write to the trash slot and take position 0. Callers write valid tokens only at
    positions their row has pages for (`PagePool.grow` first).
    """
    S = min(max(starts) + T, max_len, table.shape[1])  # rows only ever write allocated positions
    read = table[:, :S]
    pos = torch.tensor(starts)[:, None] + slots_upto(T)[None, :]  # (B, T)
    valid = pos < S
    if counts is not None:
        valid &= slots_upto(T)[None, :] < torch.tensor(counts)[:, None]
    write = read.gather(1, pos.clamp(max=S - 1)).masked_fill(~valid, trash)
    mask = slots_upto(S)[None, None, :] <= pos[:, :, None]  # (B, T, S)
    return write, read, pos.masked_fill(~valid, 0), mask[:, None]
