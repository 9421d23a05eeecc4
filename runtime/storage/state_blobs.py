"""Recurrent-state snapshots in storage: their keys and how a state blob maps onto KV-sized pages.

A hybrid model's snapshot of the state after a node's last token (docs/ARCHITECTURE.md,
"Recurrent state") is stored beside the node's KV pages, under keys derived from the page hash of
the page ending at the snapshot's position (snapshots exist only at page-aligned node ends):

    key(i) = SHA-256(b"hicache-state-key-v1\\0" || page_hash || state_id || u32 i || u32 n)[:16]

for chunk ``i`` of ``n``, where ``state_id = SHA-256(encode_state_shape(shape))[:16]`` names the
state's shape (recurrent layers, each component's name, dims and dtype). The page hash already
encodes the namespace, the KV identity and every token of the prefix; the state id keeps models
whose states differ in shape or dtype apart. KV page hashes are unchanged: the state is not part of
`KVIdentity`.

A backend instance has one fixed ``page_bytes`` (the KV page's), and a state slot is often larger
than a page, so a blob is cut into ``n = ceil(state_bytes / page_bytes)`` page-sized chunks, the
last one zero-padded. This keeps ONE backend (one directory, one eviction, one `clear_storage`) and
the backend protocol as it is; a second backend sized to the state would need its own
configuration, capacity and clear, and a node's KV and state could then be evicted apart with no
common policy. A state counts as stored only when every chunk is present and read whole.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np

from runtime.errors import LengthError, ValidationError
from runtime.memory.state_pool import StateShape
from runtime.storage.hashing import HASH_BYTES

__all__ = ["StateBlobFormat", "encode_state_shape"]

_KEY_TAG = b"hicache-state-key-v1\x00"
_SHAPE_TAG = b"hicache-state-shape-v1\x00"


def _enc_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def encode_state_shape(shape: StateShape) -> bytes:
    """Fixed encoding of a state's shape: a tag, u64 recurrent layers, u32 component count, then per
    component its name and dtype name (u32 length + UTF-8) and its dims (u32 count + u64 each)."""
    out = [_SHAPE_TAG, struct.pack("<QI", shape.num_layers, len(shape.components))]
    for c in shape.components:
        out += [_enc_str(c.name), _enc_str(str(c.dtype).removeprefix("torch.")),
                struct.pack(f"<I{len(c.shape)}Q", len(c.shape), *c.shape)]
    return b"".join(out)


@dataclass(frozen=True, slots=True)
class StateBlobFormat:
    """How one state slot's canonical bytes (`StatePool.read_slot`) are stored in a backend with
    pages of `page_bytes`: `chunks` page-sized pieces under `keys(page_hash)`."""

    state_id: bytes
    state_bytes: int
    page_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.state_id, bytes) or len(self.state_id) != HASH_BYTES:
            raise ValidationError(f"StateBlobFormat.state_id must be {HASH_BYTES} bytes")
        for name in ("state_bytes", "page_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValidationError(f"StateBlobFormat.{name} must be a positive int, got {value!r}")

    @staticmethod
    def of(shape: StateShape, page_bytes: int) -> StateBlobFormat:
        state_id = hashlib.sha256(encode_state_shape(shape)).digest()[:HASH_BYTES]
        return StateBlobFormat(state_id, shape.bytes_per_slot, page_bytes)

    @property
    def chunks(self) -> int:
        return math.ceil(self.state_bytes / self.page_bytes)

    def keys(self, page_hash: bytes) -> tuple[bytes, ...]:
        """The chunk keys of the snapshot after the page whose hash is `page_hash`."""
        if not isinstance(page_hash, bytes) or len(page_hash) != HASH_BYTES:
            raise ValidationError(f"page_hash must be a {HASH_BYTES}-byte page hash")
        n = self.chunks
        head = _KEY_TAG + page_hash + self.state_id
        return tuple(hashlib.sha256(head + struct.pack("<II", i, n)).digest()[:HASH_BYTES] for i in range(n))

    def split(self, data: np.ndarray) -> list[np.ndarray]:
        """A slot's canonical bytes (flat uint8, `state_bytes` long) as `chunks` page-sized buffers,
        the last zero-padded (fresh arrays)."""
        if data.dtype != np.uint8 or data.ndim != 1 or data.size != self.state_bytes:
            raise LengthError(f"state blob must be {self.state_bytes} uint8 bytes, got {data.shape} {data.dtype}")
        bufs = self.buffers()
        flat = bufs.reshape(-1)
        flat[:self.state_bytes] = data
        flat[self.state_bytes:] = 0
        return list(bufs)

    def buffers(self) -> np.ndarray:
        """`chunks` page-sized read buffers, one contiguous array (`join` takes it back)."""
        return np.empty((self.chunks, self.page_bytes), dtype=np.uint8)

    def join(self, bufs: np.ndarray) -> np.ndarray:
        """The slot's canonical bytes from the chunks read into `buffers()` (a view)."""
        return bufs.reshape(-1)[:self.state_bytes]
