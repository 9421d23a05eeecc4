"""Eviction policies for the radix tree.

A policy maps a node to a sort key; the smaller key is evicted first. The tree keeps
candidates in a lazily updated heap: an entry whose key went stale is re-keyed when it is
popped. That is only correct if a node's key never *decreases* while it waits in the
heap, so every policy here is built from fields that only grow (``last_access``,
``hit_count``; ``priority`` is only ever raised by the tree). A custom policy must keep
the same promise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from .radix import Node


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def key(self, node: "Node") -> tuple:
        """Sort key of an eviction candidate; smaller is evicted first."""
        ...


class LRUPolicy:
    """Least recently used first (the default)."""

    name = "lru"
    __slots__ = ()

    @staticmethod
    def key(node: "Node") -> tuple:
        return (node.last_access,)


class LFUPolicy:
    """Least frequently hit first; ties by least recently used."""

    name = "lfu"
    __slots__ = ()

    @staticmethod
    def key(node: "Node") -> tuple:
        return (node.hit_count, node.last_access)


class PriorityPolicy:
    """Lowest priority first; ties by least recently used."""

    name = "priority"
    __slots__ = ()

    @staticmethod
    def key(node: "Node") -> tuple:
        return (node.priority, node.last_access)


_POLICIES: dict[str, type] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "priority": PriorityPolicy,
}


def policy_by_name(name: str) -> EvictionPolicy:
    """`"lru"`, `"lfu"` or `"priority"` (case-insensitive) -> a policy object."""
    try:
        return _POLICIES[name.lower()]()
    except (KeyError, AttributeError):
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(_POLICIES)}") from None


__all__ = ["EvictionPolicy", "LRUPolicy", "LFUPolicy", "PriorityPolicy", "policy_by_name"]
