"""Radix prefix cache: a token-keyed radix tree whose nodes own the KV slots of their tokens.

Keys are matched and inserted in whole pages (``page_size`` tokens) so that freed ranges are
whole pages. Nodes in use by running requests are pinned (``lock_ref`` > 0); unpinned leaves are
evicted least-recently-used first. With ``disabled`` the tree stays empty: nothing is shared and
every finished request frees its slots (``--disable-radix-cache``).
"""

from __future__ import annotations

import heapq
import itertools



from engine.scheduler.kv_pool import TokenToKVPoolAllocator


class _Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: "_Node | None", key: list[int], value: list[int], tick: int):
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.key = key  # token ids on the edge into this node
        self.value = value  # KV slots of those tokens
        self.lock_ref = 0
        self.last_access = tick


class RadixCache:
    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int, disabled: bool = False):
        self.allocator = allocator
        self.page_size = page_size
        self.disabled = disabled
        self._clock = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.root = _Node(None, [], [], 0)
        self.root.lock_ref = 1
        # slots in unpinned nodes, kept up to date by insert/lock/unlock/evict so the per-step
        # KV-usage gauge needs no walk over the tree
        self.evictable_tokens = 0

    def _child_key(self, key: list[int], start: int) -> tuple[int, ...]:
        return tuple(key[start:start + self.page_size])

    def match_prefix(self, key: list[int]) -> tuple[list[int], _Node]:
        """Longest cached page-aligned prefix of ``key``: (its KV slots, the deepest node).
        Splits a node when the match ends inside its edge."""
        node, slots, pos = self.root, [], 0
        if self.disabled:
            return slots, node
        tick = next(self._clock)
        node.last_access = tick
        while len(key) - pos >= self.page_size:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            slots.extend(child.value)
            pos += n
            node = child
            node.last_access = tick
        return slots, node

    def _common_len(self, edge: list[int], key: list[int], pos: int) -> int:
        n, ps = 0, self.page_size
        while n < len(edge) and pos + n + ps <= len(key) and \
                edge[n:n + ps] == key[pos + n:pos + n + ps]:
            n += ps
        return n

    def _split(self, child: _Node, n: int) -> _Node:
        mid = _Node(child.parent, child.key[:n], child.value[:n], child.last_access)
        mid.lock_ref = child.lock_ref
        mid.children[self._child_key(child.key, n)] = child
        child.parent.children[self._child_key(child.key, 0)] = mid
        child.parent, child.key, child.value = mid, child.key[n:], child.value[n:]
        return mid

    def insert(self, key: list[int], slots: list[int]) -> int:
        """Insert a page-aligned ``key`` with its ``slots``. Returns how many leading tokens
        were already cached: the caller still owns (and must free) those duplicate slots;
        the tree now owns the rest."""
        if self.disabled:
            return 0
        matched, node = self.match_prefix(key)
        pos = len(matched)
        if pos < len(key):
            leaf = _Node(node, key[pos:], list(slots[pos:]), next(self._clock))
            node.children[self._child_key(key, pos)] = leaf
            self.evictable_tokens += len(leaf.value)
        return pos

    def lock(self, node: _Node) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.value)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.value)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unpinned leaves, LRU first, if possible.
        Returns the number freed."""
        # ties broken by the leaf's first KV slot, not id(): TP ranks must evict identically
        leaves = [(n.last_access, n.value[0], n) for n in self._all_nodes()
                  if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self.evictable_tokens -= len(leaf.value)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            if not parent.children and parent.lock_ref == 0 and parent is not self.root:
                heapq.heappush(leaves, (parent.last_access, parent.value[0], parent))
        return freed

    def _all_nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

