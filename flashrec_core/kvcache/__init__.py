"""KV storage: the token-slot pool, its allocator and the request table."""

from flashrec_core.kvcache.pool import KVPool, OutOfSlotsError, RequestTable, SlotAllocator

__all__ = ["KVPool", "OutOfSlotsError", "RequestTable", "SlotAllocator"]
