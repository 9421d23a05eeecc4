"""Who may free a slot: a request, a tree node, a session, a prefetch, or nobody."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum
from collections.abc import Hashable


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


class OwnerKind(IntEnum):
    REQUEST = 1
    NODE = 2
    SESSION = 3
    PREFETCH = 4


@dataclass(frozen=True, slots=True)
class Owner:
    """An owner of slots. `generation` keeps a reused request id apart from its previous holder."""

    kind: OwnerKind
    id: Hashable
    generation: int = 0
    # owners key the ledger's dicts on every operation: hash once (an IntEnum's hash is a
    # Python-level call)
    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def request(rid: Hashable, generation: int) -> "Owner":
        return Owner(OwnerKind.REQUEST, rid, generation)

    @staticmethod
    def node(node_id: int) -> "Owner":
        return Owner(OwnerKind.NODE, node_id)

    @staticmethod
    def session(sid: Hashable) -> "Owner":
        return Owner(OwnerKind.SESSION, sid)

    @staticmethod
    def prefetch(rid: Hashable, generation: int) -> "Owner":
        return Owner(OwnerKind.PREFETCH, rid, generation)

    def __str__(self) -> str:
        tail = f"#{self.generation}" if self.kind in (OwnerKind.REQUEST, OwnerKind.PREFETCH) else ""
        return f"{self.kind.name.lower()}:{self.id}{tail}"


def _init_owner(self: Owner, kind: OwnerKind, id: Hashable, generation: int = 0) -> None:
    # the dataclass's own frozen __init__ (object.__setattr__ per field, then __post_init__)
    # costs twice this, and an admission builds one Owner per request
    _set_kind(self, kind)
    _set_id(self, id)
    _set_generation(self, generation)
    _set_hash(self, hash((int(kind), id, generation)))


_set_kind, _set_id, _set_generation, _set_hash = (getattr(Owner, f).__set__ for f in ("kind", "id", "generation", "_hash"))
Owner.__init__ = _init_owner  # type: ignore[method-assign]
