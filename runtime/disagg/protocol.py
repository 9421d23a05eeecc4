"""The control messages between a decode runtime (`PeerBackend`) and a prefill runtime
(`PrefillServer`): msgpack over one ZMQ connection (DEALER on the decode side, ROUTER on the
prefill side, 127.0.0.1 unless the user says otherwise). The KV pages themselves never pass here:
the prefill side writes them with the transport (`runtime.disagg.transport`) straight into the
host pages the decode side reserved.

- `Hello` -> `Welcome` | `Refused`: at connect, the layouts must agree (KV identity: model,
  weights, dtype, geometry, TP shard; page size and bytes; keyed page tags or not), else the
  decode side raises `ConfigError` naming what differs.
- `Cancel` -> `Cancelled`, or the fill's own answer when its write had started: the decode side
  frees the pages it reserved for a fill only once nothing can write into them any more.
- `Fill` -> `Filled` | `Failed`: compute the KV of `tokens` (the prefill side's own tiers serve
  what they hold) and write pages `[first_page, first_page + pages)` to `dst_addrs`; `Filled`
  carries each page's integrity tag (the storage tier's `PageSeal`), checked by the decode side
  against the bytes that landed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from runtime.storage.hashing import KVIdentity

__all__ = ["Hello", "Welcome", "Refused", "Fill", "Filled", "Failed", "Cancel", "Cancelled", "encode", "decode", "identity_fields",
           "disagreement", "as_extra_key"]


class Hello(msgspec.Struct, tag=True, frozen=True):
    identity: dict[str, Any]  # `KVIdentity` fields
    page_size: int
    page_bytes: int
    keyed: bool  # page tags made with a storage key
    session: str  # the decode side's transport endpoint


class Welcome(msgspec.Struct, tag=True, frozen=True):
    session: str  # the prefill side's transport endpoint


class Refused(msgspec.Struct, tag=True, frozen=True):
    reason: str


class Fill(msgspec.Struct, tag=True, frozen=True):
    req: int
    tokens: bytes  # int32 little endian: the prompt up to the last page asked for
    extra_key: Any  # a storage namespace: None, str, bytes, int or tuples of them (`as_extra_key`)
    first_page: int
    pages: int
    keys: list[bytes]  # the decode side's page hashes of those pages (the prefill side checks them)
    dst_addrs: list[int]  # one registered destination per page, `page_bytes` each
    session: str


class Filled(msgspec.Struct, tag=True, frozen=True):
    req: int
    pages: int  # leading pages written
    tags: list[bytes]  # their integrity tags


class Failed(msgspec.Struct, tag=True, frozen=True):
    req: int
    reason: str


class Cancel(msgspec.Struct, tag=True, frozen=True):
    """The decode side stops waiting for fill `req`: if its write has not started it never will
    (answered `Cancelled`); else the fill's own answer follows once the write has ended."""

    req: int


class Cancelled(msgspec.Struct, tag=True, frozen=True):
    req: int


Message = Hello | Welcome | Refused | Fill | Filled | Failed | Cancel | Cancelled
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """A message from the peer (a `msgspec.ValidationError` / `DecodeError` for anything else)."""
    return _decoder.decode(data)


def as_extra_key(value: Any) -> Any:
    """An extra key as the decode side gave it (msgpack turns its tuples into lists)."""
    return tuple(as_extra_key(v) for v in value) if isinstance(value, list) else value


def identity_fields(identity: KVIdentity) -> dict[str, Any]:
    return dataclasses.asdict(identity)


def disagreement(hello: Hello, identity: KVIdentity, page_size: int, page_bytes: int, keyed: bool) -> str | None:
    """What differs between the peer's layout (`hello`) and ours; None when they agree."""
    ours = identity_fields(identity)
    diff = [f"{k}: {hello.identity.get(k)!r} there, {v!r} here" for k, v in ours.items() if hello.identity.get(k) != v]
    if hello.page_size != page_size:
        diff.append(f"page_size: {hello.page_size} there, {page_size} here")
    if hello.page_bytes != page_bytes:
        diff.append(f"page_bytes: {hello.page_bytes} there, {page_bytes} here")
    if hello.keyed != keyed:
        diff.append(f"page tags keyed (storage_key): {hello.keyed} there, {keyed} here")
    return "; ".join(diff) or None
