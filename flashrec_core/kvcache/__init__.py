"""KV storage: the token-slot pool, its allocator and the request table."""

from flashrec_core.kvcache.pool import KVPool, OutOfSlotsError, RequestTable, SlotAllocator
from flashrec_core.kvcache.radix import RadixCache, RadixNode

__all__ = ["KVPool", "OutOfSlotsError", "RadixCache", "RadixNode", "RequestTable", "SlotAllocator"]
