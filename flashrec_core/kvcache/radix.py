"""Radix prefix cache: prompts that share a prefix (a system prompt, a user's history) reuse
its KV slots instead of recomputing them.

A radix tree over token ids; each edge holds a run of tokens and the pool slots that hold their
K/V. Requests in flight lock the path they matched so it cannot be evicted under them; unlocked
leaves are evicted least-recently-used first when the pool runs short. The cache owns the slots
it holds: a request hands its prompt slots over with `insert` instead of freeing them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from flashrec_core.kvcache.pool import SlotAllocator

_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...] = ()
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)
    locks: int = 0
    last_used: int = 0


class RadixCache:
    """Longest-prefix match, insert, lock/unlock and LRU eviction over token-slot runs."""

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.root = RadixNode()
        self.num_cached = 0

    def match(
        self, tokens: list[int] | tuple[int, ...], limit: int
    ) -> tuple[torch.Tensor, RadixNode]:
        """Slots of the longest cached prefix of tokens[:limit], and the node it ends in (lock
        it while the slots are in use). A match may end inside an edge: the edge is split."""
        node, pos, parts = self.root, 0, []
        while pos < limit and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            common = _common_length(child.tokens, tokens[pos:limit])
            if common < len(child.tokens):
                child = self._split(child, common)
            parts.append(child.slots)
            pos += common
            node = child
            node.last_used = next(_clock)
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return slots, node

    def insert(self, tokens: list[int] | tuple[int, ...], slots: torch.Tensor) -> RadixNode:
        """Hand a prompt's slots to the cache; slots of a part already cached are freed."""
        assert len(tokens) == slots.numel(), "one slot per token"
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = RadixNode(tuple(tokens[pos:]), slots[pos:].clone(), node)
                new.last_used = next(_clock)
                node.children[tokens[pos]] = new
                self.num_cached += len(new.tokens)
                return new
            common = _common_length(child.tokens, tokens[pos:])
            if common < len(child.tokens):
                child = self._split(child, common)
            duplicate = slots[pos : pos + common]
            mine = duplicate != child.slots
            if mine.any():
                self.allocator.free(duplicate[mine])
            pos += common
            node = child
            node.last_used = next(_clock)
        return node

    def lock(self, node: RadixNode) -> None:
        while node is not None and node is not self.root:
            node.locks += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not None and node is not self.root:
            assert node.locks > 0, "unlock without lock"
            node.locks -= 1
            node = node.parent  # type: ignore[assignment]

    def num_locked_nodes(self) -> int:
        """Nodes held by requests in flight (0 when the engine is idle)."""
        return sum(1 for n in self._nodes() if n.locks > 0)

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves, oldest first; returns the count.

        One pass over the tree and a heap of evictable leaves (a parent whose last child goes
        joins the heap), so a wave's eviction costs O(nodes log nodes) however many go."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.locks == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, victim = heapq.heappop(heap)
            self.allocator.free(victim.slots)
            freed += victim.slots.numel()
            self.num_cached -= victim.slots.numel()
            parent = victim.parent
            assert parent is not None, "the root is never a leaf victim"
            del parent.children[victim.tokens[0]]
            if parent is not self.root and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge after `at` tokens; returns the new upper node."""
        assert node.parent is not None and 0 < at < len(node.tokens), "split inside an edge"
        upper = RadixNode(
            node.tokens[:at], node.slots[:at], node.parent, {}, node.locks, node.last_used
        )
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.slots, node.parent = node.tokens[at:], node.slots[at:], upper
        upper.children[node.tokens[0]] = node
        return upper

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common_length(a: tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
