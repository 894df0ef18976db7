"""KV memory: request slots (``ReqToTokenPool``), paged KV slot allocation
(``TokenToKVPoolAllocator``) and the per-layer K/V tensors (``KVCache``).

As in SGLang (shared/reference/sglang-facts.md, section 6.3), page 0 is reserved: slot 0 is the
dummy write target for padded tokens (CUDA-graph padding, DP padding), never handed out.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """``req_to_token`` [size, max_context_len] int32: row r, column p = the KV slot of token p
    of the request holding row r. Rows come from a free list.

    The last ``reserved`` rows are never handed out: they stay all zeros (slot 0, the dummy
    page), so padded dummy requests (CUDA-graph padding) can point at them.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device,
                 reserved: int = 0):
        self.size = size
        self.num_usable = size - reserved
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)
        self.free_rows = list(range(self.num_usable))

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)

    def clear(self) -> None:
        self.free_rows = list(range(self.num_usable))


class TokenToKVPoolAllocator:
    """Hands out KV slots a page at a time: slot = page * page_size + offset.

    ``num_pages`` usable pages numbered 1..num_pages (page 0 is the reserved dummy page).
    A request's tokens fill its last page before a new page is taken, so freeing a
    page-aligned range returns whole pages. Freed pages are reused first (last freed, lowest
    first); pages never handed out since the last ``clear`` are the range ``next_page ..
    num_pages``, so ``clear`` is O(1) even for a million pages (it runs on every weight update).
    """

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self.free_pages: list[int] = []  # returned pages, popped from the end
        self.next_page = 1  # pages next_page..num_pages were never handed out

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def available_tokens(self) -> int:
        return (len(self.free_pages) + self.num_pages + 1 - self.next_page) * self.page_size

    def pages_needed(self, seq_len: int, n: int) -> int:
        """Pages to add so a request holding ``seq_len`` tokens can hold ``seq_len + n``."""
        ps = self.page_size
        return -(-(seq_len + n) // ps) - (-(-seq_len // ps))

    def alloc(self, seq_len: int, last_slot: int, n: int) -> list[int] | None:
        """Slots for tokens ``seq_len .. seq_len + n - 1`` of a request whose token
        ``seq_len - 1`` sits in ``last_slot`` (ignored when seq_len is page-aligned).
        Returns None, allocating nothing, when not enough pages are free."""
        need = self.pages_needed(seq_len, n)
        if need * self.page_size > self.available_tokens:
            return None
        ps = self.page_size
        slots: list[int] = []
        room = (-seq_len) % ps
        if room:
            slots.extend(range(last_slot + 1, last_slot + 1 + min(room, n)))
        for _ in range(need):
            if self.free_pages:
                page = self.free_pages.pop()
            else:
                page, self.next_page = self.next_page, self.next_page + 1
            slots.extend(range(page * ps, page * ps + ps))
        return slots[:n]

    def free(self, slots: list[int] | torch.Tensor) -> None:
        """Free the pages of ``slots`` (a page-aligned range of one request's tokens)."""
        if isinstance(slots, torch.Tensor):
            slots = slots.tolist()
        ps = self.page_size
        self.free_pages.extend(sorted({s // ps for s in slots}, reverse=True))

    def clear(self) -> None:
        self.free_pages = []
        self.next_page = 1


class KVCache:
    """Per-layer K and V tensors [num_slots, num_kv_heads, head_dim], num_slots =
    (num_pages + 1) * page_size (the +1 is the reserved dummy page). Each layer's K and V are
    the two halves of one tensor ``kv_buffers[l]`` [2, num_slots, H, D], so a backend can write
    a token's K and V with one scatter."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        slots = (num_pages + 1) * page_size
        shape = (2, slots, num_kv_heads, head_dim)
        self.kv_buffers = [torch.zeros(shape, dtype=dtype, device=device)
                           for _ in range(num_layers)]
        self.k_buffers = [kv[0] for kv in self.kv_buffers]
        self.v_buffers = [kv[1] for kv in self.kv_buffers]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
