"""Page hashes: the storage tier's address of a page, identical in every process.

``h(0) = H(seed || tokens of page 0)``, ``h(i) = H(h(i-1) || tokens of page i)`` where

- ``H`` is SHA-256 (the seed through ``hashlib``, the pages through `runtime.storage.hash_chain`) truncated to its first 16 bytes (``HASH_BYTES``). 128 bits
  keep the chance of any collision among 2**40 stored pages below 2**-48; truncation only
  shortens keys and file names. With ``hash_algo="xxhash"`` (`KVIdentity.hash_algo`) the pages
  are chained with XXH3-128 instead (its whole 16-byte digest): as unlikely to collide by
  chance, but not collision resistant against someone choosing tokens on purpose (the seed
  stays SHA-256; the algorithm is part of the identity, so the two never share a page).
- the tokens of a page are ``page_size`` int32 values in little-endian byte order;
- ``seed = H(seed_bytes(extra_key, identity))``, a fixed, versioned, length-prefixed
  encoding of the namespace and of the KV identity (model id, weight version, KV dtype,
  layers, KV heads, head dim; when set, the page layout, the tensor-parallel shard and the
  per-token KV layout: MLA's one latent vs K and V). The
  namespace (``extra_key``) is what the façade accepts: ``None``, ``str``, ``bytes``, ``int``
  (exactly: not ``bool``, not numpy integers) and tuples of these, nested. Its encoding is
  typed (a tag byte per type) and length-prefixed, tuples recursively, so that values which
  Python finds equal or which print alike never share a seed: ``None``, ``""``, ``b""``,
  ``()``, ``0``, ``"0"``, ``b"0"``, ``(0,)`` and ``((0,),)`` all differ.

Nothing here depends on Python's salted ``hash()``, on the host pool layout or on the
process, so two processes (or machines) with the same model and tokens agree on every
page's address, and a different namespace, dtype, shape or weight version never does.
Only whole pages are hashed; a trailing partial page has no hash.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, replace
from collections.abc import Hashable, Sequence
from typing import Union

import numpy as np

from runtime.config import HASH_ALGOS, KV_LAYOUTS
from runtime.errors import LengthError, ValidationError
from runtime.storage.hash_chain import chain_function

DIGEST_NAME = "sha256-128"
HASH_BYTES = 16
_FORMAT_TAG = b"hicache-page-hash-v1\x00"
_sha256 = hashlib.sha256
# a shard's KV is the same on every rank (MLA's latent): one stored copy serves every rank and TP size
REPLICATED = "replicated"
_TP_SHARD = re.compile(r"tp(0|[1-9][0-9]*)of([1-9][0-9]*)")


def tp_shard(tp_rank: int, tp_size: int) -> str:
    """The `KVIdentity.shard` of rank `tp_rank` of `tp_size` whose KV heads are split across ranks:
    "" (unsharded) when `tp_size` is 1, else "tp{rank}of{size}"."""
    for name, value in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        if type(value) is not int:
            raise ValidationError(f"{name} must be an int, got {value!r}")
    if tp_size < 1:
        raise ValidationError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValidationError(f"tp_rank must be in [0, tp_size) = [0, {tp_size}), got {tp_rank}")
    return "" if tp_size == 1 else f"tp{tp_rank}of{tp_size}"


def rank_identities(identity: "KVIdentity", tp_ranks: int) -> tuple["KVIdentity", ...]:
    """The identities of the `tp_ranks` ranks one control plane drives, whose rank 0 is `identity`:
    one per rank, each its own shard; () when one key list serves every rank (one rank, or a
    REPLICATED shard: rank 0 writes the one copy and every rank reads it)."""
    if tp_ranks == 1 or identity.shard == REPLICATED:
        return ()
    if identity.shard != tp_shard(0, tp_ranks):
        raise ValidationError(f"rank 0 of {tp_ranks} ranks has shard {tp_shard(0, tp_ranks)!r}, got {identity.shard!r}")
    return tuple(replace(identity, shard=tp_shard(r, tp_ranks)) for r in range(tp_ranks))


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """What makes stored KV bytes reusable: same model weights, same dtype, same per-token shape."""

    model_id: str
    weight_version: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # how a page's bytes are laid out, when not the runtime's own host pool layout ("": that one;
    # e.g. a vLLM connector's pages are vLLM blocks): pages of different layouts never share a hash
    page_layout: str = ""
    # which part of the instance's KV a page holds under tensor parallelism: "" (all of it: one
    # rank, the default), "tp{r}of{n}" (rank r's KV heads of n ranks; `tp_shard`), or REPLICATED
    # (the same bytes on every rank, MLA's latent). Shards never share a hash, so a rank never
    # reads another rank's heads from a shared storage directory.
    shard: str = ""
    # what a token's KV is (`RuntimeConfig.kv_layout`): "mha" (K and V) or "mla" (one latent vector).
    # An MLA page never shares a hash with an MHA page of the same byte size and geometry.
    kv_layout: str = "mha"
    # the page hash (`RuntimeConfig.hash_algo`): pages hashed with different ones never share a key
    hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        for name in ("model_id", "weight_version", "kv_dtype", "page_layout", "shard", "kv_layout", "hash_algo"):
            if not isinstance(getattr(self, name), str):
                raise ValidationError(f"KVIdentity.{name} must be a str, got {getattr(self, name)!r}")
        if self.shard not in ("", REPLICATED):
            m = _TP_SHARD.fullmatch(self.shard)
            if m is None or not 0 <= int(m[1]) < int(m[2]) or m[2] == "1":
                raise ValidationError(f"KVIdentity.shard must be '', {REPLICATED!r} or 'tp<rank>of<size>' with "
                                      f"0 <= rank < size and size >= 2, got {self.shard!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValidationError(f"KVIdentity.hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValidationError(f"KVIdentity.kv_layout must be one of {sorted(KV_LAYOUTS)}, got {self.kv_layout!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValidationError(f"KVIdentity.{name} must be a positive int, got {value!r}")

    @staticmethod
    def from_config(config: object) -> "KVIdentity":
        """The identity of a `RuntimeConfig` (or anything with the same attribute names). An MLA
        config's shard is REPLICATED whatever its TP size: every rank holds the same latent, so
        one stored copy serves every rank of every instance."""
        layout = getattr(config, "kv_layout", "mha")
        shard = tp_shard(getattr(config, "tp_rank", 0), getattr(config, "tp_size", 1))
        return KVIdentity(
            model_id=config.model_id,  # type: ignore[attr-defined]
            weight_version=config.weight_version,  # type: ignore[attr-defined]
            kv_dtype=config.kv_dtype,  # type: ignore[attr-defined]
            num_layers=config.num_layers,  # type: ignore[attr-defined]
            num_kv_heads=config.num_kv_heads,  # type: ignore[attr-defined]
            head_dim=config.head_dim,  # type: ignore[attr-defined]
            shard=REPLICATED if layout == "mla" else shard,
            kv_layout=layout,
            hash_algo=getattr(config, "hash_algo", "sha256"),
        )

    def encode(self) -> bytes:
        """Fixed byte encoding: length-prefixed UTF-8 strings, then three little-endian u64, then
        the page layout as a length-prefixed string when it, the shard or the KV layout is set, then
        the shard as one when it or the KV layout is set, then the KV layout when it or the hash
        is not the default, then the hash algorithm when not "sha256". Defaults add nothing (the
        runtime's own layout, one rank, K and V, SHA-256 encode as before these fields existed, so
        their hashes did not change); each trailing string implies the ones before it (maybe
        empty), so zero to four of them parse back one way only."""
        tail = b""
        if self.hash_algo != "sha256":
            tail = (_enc_str(self.page_layout) + _enc_str(self.shard) + _enc_str(self.kv_layout)
                    + _enc_str(self.hash_algo))
        elif self.kv_layout != "mha":
            tail = _enc_str(self.page_layout) + _enc_str(self.shard) + _enc_str(self.kv_layout)
        elif self.shard:
            tail = _enc_str(self.page_layout) + _enc_str(self.shard)
        elif self.page_layout:
            tail = _enc_str(self.page_layout)
        return (
            _enc_str(self.model_id)
            + _enc_str(self.weight_version)
            + _enc_str(self.kv_dtype)
            + struct.pack("<QQQ", self.num_layers, self.num_kv_heads, self.head_dim)
            + tail
        )


def _enc_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


ExtraKey = Union[None, str, bytes, int, tuple]  # tuples of ExtraKey, nested


def _enc_extra_key(extra_key: ExtraKey) -> bytes:
    """Tag byte, then the content: ``0`` None; ``1`` u32 length + UTF-8 (str); ``2`` u32 length
    + bytes; ``3`` u32 length + the int as minimal signed little-endian two's complement; ``4``
    u32 count + each element's encoding (tuple). The tags keep types apart, the lengths keep
    neighbours apart (so a tuple's encoding parses back one way only). None, str and bytes
    encode as in the first version of this format, so their hashes did not change."""
    kind = type(extra_key)
    if extra_key is None:
        return b"\x00"
    if kind is str:
        return b"\x01" + _enc_str(extra_key)  # type: ignore[arg-type]
    if kind is bytes or kind is bytearray:
        return b"\x02" + struct.pack("<I", len(extra_key)) + bytes(extra_key)  # type: ignore[arg-type]
    if kind is int:  # exact: True, np.int64(1) and 1.0 equal 1 in Python but are refused, not merged
        n: int = extra_key  # type: ignore[assignment]
        raw = n.to_bytes(n.bit_length() // 8 + 1, "little", signed=True)
        return b"\x03" + struct.pack("<I", len(raw)) + raw
    if kind is tuple:
        items: tuple = extra_key  # type: ignore[assignment]
        return b"\x04" + struct.pack("<I", len(items)) + b"".join(_enc_extra_key(k) for k in items)
    raise ValidationError(f"extra_key must be None, str, bytes, int or a tuple of these, got {kind.__name__}")


def seed_bytes(extra_key: ExtraKey, identity: KVIdentity) -> bytes:
    """The exact bytes hashed into the chain's seed (exposed for tests and other implementations)."""
    return _FORMAT_TAG + _enc_extra_key(extra_key) + identity.encode()


def chain_seed(extra_key: ExtraKey, identity: KVIdentity) -> bytes:
    """``h(-1)``: the link every chain of this namespace and identity starts from."""
    return _sha256(seed_bytes(extra_key, identity)).digest()[:HASH_BYTES]


def page_hashes(
    tokens: np.ndarray,
    page_size: int,
    extra_key: ExtraKey,
    identity: KVIdentity,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hashes of every whole page of ``tokens`` (a trailing partial page is ignored).

    ``parent`` continues a chain: the hash of the page just before ``tokens[0]`` (then
    ``extra_key`` and ``identity`` are already folded into it and are not used again).
    ``tokens`` must be 1-D integers in int32 range; any int dtype is accepted and encoded as
    little-endian int32.
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise LengthError(f"page_size must be a positive int, got {page_size!r}")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise LengthError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.dtype("<i4"):
        if arr.size and arr.dtype.kind not in "iu":
            raise ValidationError(f"tokens must be integers, got dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31):
            raise ValidationError("token ids out of int32 range")
        arr = arr.astype("<i4")
    n_pages = arr.shape[0] // page_size
    if n_pages == 0:
        return []
    if parent is None:
        prev = chain_seed(extra_key, identity)
    else:
        if not isinstance(parent, (bytes, bytearray)) or len(parent) != HASH_BYTES:
            raise ValidationError(f"parent must be a {HASH_BYTES}-byte page hash")
        prev = bytes(parent)
    chain = chain_function(identity.hash_algo)
    blob = chain(prev, np.ascontiguousarray(arr[: n_pages * page_size]).tobytes(), page_size * 4)
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


def rank_page_keys(tokens: np.ndarray, page_size: int, extra_key: Hashable, ranks: Sequence["KVIdentity"],
                   keys: list[bytes], pages: Sequence[int]) -> tuple[tuple[bytes, ...], ...]:
    """Every rank's keys of pages `pages` (ascending) of `tokens`, rank 0's being `keys`: the
    prefix hashed once per rank's shard (`ranks`: every rank's identity). () when `keys` serve
    every rank (no `ranks`)."""
    if not ranks or not keys:
        return ()
    head = tokens[:(pages[-1] + 1) * page_size]
    others = []
    for identity in ranks[1:]:
        every = page_hashes(head, page_size, extra_key, identity)
        others.append(tuple(every[i] for i in pages))
    return (tuple(keys), *others)

