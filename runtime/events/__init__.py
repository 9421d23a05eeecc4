"""KV cache events: what the runtime holds, per tier, as vLLM's `KVEventBatch` stream (docs/EVENTS.md)."""

from .hub import EventHub, EventsLostError, EventSubscription
from .index import PrefixHit, PrefixIndex
from .wire import CPU, GPU, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode, encode

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "CPU", "EventHub", "EventSubscription",
           "EventsLostError", "GPU", "KVEventBatch", "PrefixHit", "PrefixIndex", "STORAGE", "decode", "encode"]
