"""KV memory of requests: a ``req_to_token`` row, paged KV slots and the radix prefix cache.

``admit`` pins a request's cached prefix, ``alloc_extend``/``alloc_slots`` grow its KV (evicting
unpinned cache leaves when short), ``release`` hands its computed KV to the prefix cache.
"""

from __future__ import annotations

import torch

from engine.scheduler.kv_pool import ReqToTokenPool, TokenToKVPoolAllocator
from engine.scheduler.prefix_cache import RadixCache
from engine.types import Req


class ReqMemory:
    def __init__(self, allocator: TokenToKVPoolAllocator, req_pool: ReqToTokenPool,
                 tree: RadixCache, page_size: int):
        self.allocator = allocator
        self.req_pool = req_pool
        self.tree = tree
        self.page_size = page_size

    def admit(self, req: Req) -> bool:
        """Give a waiting request a req_to_token row and its cached prefix."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        key = req.fill_ids[:-1]
        if req.return_logprob and req.logprob_start_len >= 0 and not req.prompt_logprobs_done:
            key = key[:max(0, req.logprob_start_len - 1)]  # those positions need logits
        slots, node = self.tree.match_prefix(key)
        self.tree.lock(node)
        req.prefix_node = node
        req.kv_slots = list(slots)
        req.num_computed_tokens = req.num_cached_in_tree = len(slots)
        if slots:
            self.req_pool.req_to_token[row, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
        return True

    def alloc_slots(self, req: Req, n: int) -> bool:
        seq = req.num_computed_tokens
        last = req.kv_slots[seq - 1] if seq else 0
        slots = self.allocator.alloc(seq, last, n)
        if slots is None:
            self.tree.evict(self.allocator.pages_needed(seq, n) * self.page_size)
            slots = self.allocator.alloc(seq, last, n)
        if slots is None:
            return False
        req.kv_slots[seq:] = slots
        # req_to_token[row, seq:seq + n] is written on the device by ModelRunner.forward from
        # the batch's out_cache_loc (one kernel per step instead of one H2D copy per request)
        return True

    def alloc_extend(self, req: Req, budget: int) -> int:
        """Allocate KV for the next chunk of ``req`` (at most ``budget`` tokens, shrunk to
        what memory allows). Returns the chunk length, 0 if nothing fits."""
        n = min(req.seq_len - req.num_computed_tokens, budget)
        while n > 0 and not self.alloc_slots(req, n):
            n //= 2
        return n

    def release(self, req: Req) -> None:
        """Return ``req``'s KV: computed page-aligned tokens go to the prefix cache (the tree
        keeps one copy; duplicates and the unaligned tail are freed), the row is freed."""
        if req.req_pool_idx is None:
            return
        n = req.num_computed_tokens
        slots = req.kv_slots
        aligned = n // self.page_size * self.page_size
        own_from = req.num_cached_in_tree
        if not self.tree.disabled and aligned > 0:
            dup = self.tree.insert(req.fill_ids[:aligned], slots[:aligned])
            self.allocator.free(slots[own_from:max(own_from, dup)])
            own_from = aligned
        self.allocator.free(slots[own_from:])
        self.tree.unlock(req.prefix_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.prefix_node, req.kv_slots = None, None, []
        req.num_computed_tokens = req.num_cached_in_tree = 0
