"""Page-hash chain: stable across processes, isolated by namespace and identity, chained."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.errors import LengthError, ValidationError
from runtime.storage.hashing import (HASH_BYTES, REPLICATED, KVIdentity, chain_seed, page_hashes, seed_bytes,
                                     tp_shard)

IDENT = KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 64)
TOKENS = np.arange(48, dtype=np.int32)
# Pinned: changing the encoding changes every stored page's address; bump the format tag then.
KNOWN = ["8a77226b84047cbfb3aedd888c4b70cf", "f12214c3c1b80399448da867b9156e01", "4d471e53565cb36ecf1496d6e90aa438"]


def test_known_vector():
    assert [h.hex() for h in page_hashes(TOKENS, 16, "tenant-a", IDENT)] == KNOWN


def test_matches_the_documented_spec():
    # an independent re-implementation from the module docstring
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<I", len(b)) + b

    seed_in = (b"hicache-page-hash-v1\x00" + b"\x01" + s("tenant-a") + s("HuggingFaceTB/SmolLM2-135M") + s("main")
               + s("bfloat16") + struct.pack("<QQQ", 30, 3, 64))
    assert seed_bytes("tenant-a", IDENT) == seed_in
    prev = hashlib.sha256(seed_in).digest()[:16]
    want = []
    for p in range(3):
        page = struct.pack("<16i", *range(16 * p, 16 * p + 16))
        prev = hashlib.sha256(prev + page).digest()[:16]
        want.append(prev)
    assert page_hashes(TOKENS, 16, "tenant-a", IDENT) == want


def test_stable_across_processes():
    code = (
        "import numpy as np\n"
        "from runtime.storage.hashing import KVIdentity, page_hashes\n"
        "i = KVIdentity('HuggingFaceTB/SmolLM2-135M', 'main', 'bfloat16', 30, 3, 64)\n"
        "print(','.join(h.hex() for h in page_hashes(np.arange(48, dtype=np.int32), 16, 'tenant-a', i)))\n"
    )
    # a different hash seed in the child: Python's hash() must play no part
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}, cwd=_repo_root())
    assert out.stdout.strip().split(",") == KNOWN


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[3])


def test_shape_and_partial_pages():
    hs = page_hashes(np.arange(50, dtype=np.int32), 16, None, IDENT)
    assert len(hs) == 3 and all(len(h) == HASH_BYTES for h in hs)
    assert page_hashes(np.arange(15, dtype=np.int32), 16, None, IDENT) == []
    # the trailing partial page does not change the whole pages' hashes
    assert hs == page_hashes(np.arange(48, dtype=np.int32), 16, None, IDENT)


@pytest.mark.parametrize("other", [
    dict(extra_key="tenant-b"),
    dict(extra_key=""),
    dict(extra_key=None),
    dict(extra_key=b"tenant-a"),
    dict(identity=KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "float16", 30, 3, 64)),
    dict(identity=KVIdentity("HuggingFaceTB/SmolLM2-135M", "v2", "bfloat16", 30, 3, 64)),
    dict(identity=KVIdentity("other-model", "main", "bfloat16", 30, 3, 64)),
    dict(identity=KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 29, 3, 64)),
    dict(identity=KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 2, 64)),
    dict(identity=KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 128)),
    dict(identity=KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 64, "vllm-block")),
    dict(identity=KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 64, shard="tp0of2")),
    dict(identity=KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 64, shard=REPLICATED)),
])
def test_namespace_and_identity_isolation(other):
    base = page_hashes(TOKENS, 16, "tenant-a", IDENT)
    kw = dict(extra_key="tenant-a", identity=IDENT)
    kw.update(other)
    alt = page_hashes(TOKENS, 16, kw["extra_key"], kw["identity"])
    assert not set(base) & set(alt)


def test_none_and_empty_extra_key_differ():
    assert chain_seed(None, IDENT) != chain_seed("", IDENT) != chain_seed(b"", IDENT)
    assert chain_seed(None, IDENT) != chain_seed(b"", IDENT)


NAMESPACES = [None, "", b"", (), 0, 1, -1, "1", b"1", (1,), ((1,),), ("1",), (b"1",), (1, 2), ((1, 2),), ((1,), 2),
              (1, (2,)), (None,), (None, None), ("a", "b"), ("ab",), ("a", ("b",)), 255, 256, -256, 2**64, -(2**64),
              (0,), (0, 0), "\x00", b"\x00", ("",), ((),), ((), ())]


def test_typed_namespaces_never_share_a_seed():
    """Every namespace the façade accepts (None, str, bytes, exact int, tuples of these, nested)
    has its own seed: 1, "1", b"1", (1,) and ((1,),) differ, as do values Python finds equal
    (0 and (0,) vs (0, 0)) or whose elements could be regrouped. Before the fix an int or a tuple
    namespace raised ValidationError."""
    seeds = [chain_seed(ns, IDENT) for ns in NAMESPACES]
    assert len(set(seeds)) == len(NAMESPACES)
    # the seed encodings themselves are distinct and none is a prefix of another element's
    # encoding inside a tuple: (("a",), "b") and ("a", ("b",)) differ although they flatten alike
    assert chain_seed((("a",), "b"), IDENT) != chain_seed(("a", ("b",)), IDENT)
    # stable: an equal value built another way gives the same seed
    assert chain_seed(tuple([1, (2, "x")]), IDENT) == chain_seed((1, (2, "x")), IDENT)
    assert chain_seed(10**30, IDENT) == chain_seed(int("1" + "0" * 30), IDENT)


def test_namespace_encoding_spec():
    """The documented encoding, re-implemented: int is tag 3 + u32 length + minimal signed
    little-endian bytes; a tuple is tag 4 + u32 count + its elements. Before the fix seed_bytes(1, ...)
    raised ValidationError."""
    head, tail = b"hicache-page-hash-v1\x00", IDENT.encode()
    assert seed_bytes(1, IDENT) == head + b"\x03" + struct.pack("<I", 1) + b"\x01" + tail
    assert seed_bytes(-1, IDENT) == head + b"\x03" + struct.pack("<I", 1) + b"\xff" + tail
    assert seed_bytes(128, IDENT) == head + b"\x03" + struct.pack("<I", 2) + b"\x80\x00" + tail
    assert seed_bytes(0, IDENT) == head + b"\x03" + struct.pack("<I", 1) + b"\x00" + tail
    assert seed_bytes((1, "a"), IDENT) == (head + b"\x04" + struct.pack("<I", 2) + b"\x03" + struct.pack("<I", 1)
                                           + b"\x01" + b"\x01" + struct.pack("<I", 1) + b"a" + tail)
    assert seed_bytes((), IDENT) == head + b"\x04" + struct.pack("<I", 0) + tail


@pytest.mark.parametrize("bad", [True, False, 1.0, np.int64(1), np.int32(1), [1], {"a": 1}, (1, True), ((1.5,),),
                                 frozenset({1}), object()])
def test_namespaces_of_other_types_are_refused(bad):
    """Python-equal stand-ins for an int (True, 1.0, numpy integers) are refused, never merged
    with the int's namespace; so are lists, dicts and other objects, also inside tuples."""
    with pytest.raises(ValidationError):
        chain_seed(bad, IDENT)


def test_int_and_tuple_namespaces_are_stable_across_processes():
    """No Python hash() in the namespace encoding. Before the fix page_hashes(..., 7, ...) raised."""
    code = (
        "import numpy as np\n"
        "from runtime.storage.hashing import KVIdentity, page_hashes\n"
        "i = KVIdentity('HuggingFaceTB/SmolLM2-135M', 'main', 'bfloat16', 30, 3, 64)\n"
        "for ns in (7, ('t', 7, (b'x', None)), -(2**70)):\n"
        "    print(page_hashes(np.arange(16, dtype=np.int32), 16, ns, i)[0].hex())\n"
    )
    here = [page_hashes(np.arange(16, dtype=np.int32), 16, ns, IDENT)[0].hex()
            for ns in (7, ("t", 7, (b"x", None)), -(2**70))]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "999", "PATH": "/usr/bin:/bin"}, cwd=_repo_root())
    assert out.stdout.split() == here and len(set(here)) == 3


def test_chaining():
    base = page_hashes(np.arange(64, dtype=np.int32), 16, None, IDENT)
    t = np.arange(64, dtype=np.int32)
    t[3] = 999  # page 0 changes: every later hash changes
    changed = page_hashes(t, 16, None, IDENT)
    assert all(a != b for a, b in zip(base, changed))
    t = np.arange(64, dtype=np.int32)
    t[40] = 999  # page 2 changes: pages 0, 1 keep theirs
    changed = page_hashes(t, 16, None, IDENT)
    assert changed[:2] == base[:2] and changed[2] != base[2] and changed[3] != base[3]
    # same page content at another position has another hash
    rep = page_hashes(np.tile(np.arange(16, dtype=np.int32), 3), 16, None, IDENT)
    assert len(set(rep)) == 3


def test_parent_continues_the_chain():
    full = page_hashes(np.arange(64, dtype=np.int32), 16, "x", IDENT)
    tail = page_hashes(np.arange(32, 64, dtype=np.int32), 16, "x", IDENT, parent=full[1])
    assert tail == full[2:]


def test_other_int_dtypes_encode_as_int32():
    a = page_hashes(np.arange(32, dtype=np.int32), 16, None, IDENT)
    assert page_hashes(np.arange(32, dtype=np.int64), 16, None, IDENT) == a
    assert page_hashes(np.arange(32, dtype=">i4"), 16, None, IDENT) == a
    assert page_hashes(list(range(32)), 16, None, IDENT) == a
    with pytest.raises(ValidationError):
        page_hashes(np.array([2**31] * 16, dtype=np.int64), 16, None, IDENT)
    with pytest.raises(ValidationError):
        page_hashes(np.zeros(16, dtype=np.float32), 16, None, IDENT)


def test_validation():
    with pytest.raises(LengthError):
        page_hashes(TOKENS, 0, None, IDENT)
    with pytest.raises(LengthError):
        page_hashes(TOKENS.reshape(3, 16), 16, None, IDENT)
    with pytest.raises(ValidationError):
        page_hashes(TOKENS, 16, 5.0, IDENT)  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        page_hashes(TOKENS, 16, None, IDENT, parent=b"short")
    with pytest.raises(ValidationError):
        KVIdentity("m", "w", "bfloat16", 0, 3, 64)


# -- tensor-parallel shards ------------------------------------------------------------------

# Pinned before the shard field existed: a page layout alone encodes as it did, so the vLLM
# connector's stored pages keep their addresses (the default identity's are KNOWN, above).
KNOWN_LAYOUT = ["5b965626fe0d012620bc551064b84254", "a5d0f37b70cd18732bc63ce849a6a32c", "054bb414d817056765a0e96d07bb0639"]
KNOWN_TP1OF2 = ["f3c005c74067f183a4880bf3bc3eb921", "c7c39079fcf4ae070177b238e45c1e1c", "f8120b9a1b341052f1ef7250dfe8760f"]


def test_known_vectors_with_layout_and_shard():
    layout = KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 64, "vllm-block:3x16x128")
    assert [h.hex() for h in page_hashes(TOKENS, 16, None, layout)] == KNOWN_LAYOUT
    shard = KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 64, shard=tp_shard(1, 2))
    assert [h.hex() for h in page_hashes(TOKENS, 16, "tenant-a", shard)] == KNOWN_TP1OF2
    # one rank of one is the unsharded identity: its hashes are the pinned ones
    one = KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 64, shard=tp_shard(0, 1))
    assert one == IDENT and [h.hex() for h in page_hashes(TOKENS, 16, "tenant-a", one)] == KNOWN


def test_shard_encoding_spec():
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<I", len(b)) + b

    head = s("m") + s("w") + s("bfloat16") + struct.pack("<QQQ", 30, 3, 64)
    assert KVIdentity("m", "w", "bfloat16", 30, 3, 64, shard="tp1of2").encode() == head + s("") + s("tp1of2")
    assert KVIdentity("m", "w", "bfloat16", 30, 3, 64, "L", shard="tp1of2").encode() == head + s("L") + s("tp1of2")
    # a layout spelled like a shard is not that shard: the shard always comes second
    assert KVIdentity("m", "w", "bfloat16", 30, 3, 64, "tp1of2").encode() == head + s("tp1of2")
    assert chain_seed(None, KVIdentity("m", "w", "bfloat16", 30, 3, 64, "tp1of2")) != chain_seed(
        None, KVIdentity("m", "w", "bfloat16", 30, 3, 64, shard="tp1of2"))


@pytest.mark.parametrize("size", [2, 4, 8])
def test_every_rank_and_size_has_its_own_pages(size):
    others = [tp_shard(r, n) for n in (2, 4, 8) for r in range(n)] + ["", REPLICATED]
    mine = {tp_shard(r, size) for r in range(size)}
    chains = {sh: set(page_hashes(TOKENS, 16, None, KVIdentity("m", "w", "bfloat16", 30, 3, 64, shard=sh)))
              for sh in others}
    for sh in mine:
        assert all(not chains[sh] & chains[o] for o in others if o != sh)


@pytest.mark.parametrize("rank,size", [(-1, 2), (2, 2), (0, 0), (1, 1), (True, 2), (0, 2.0)])
def test_tp_shard_validation(rank, size):
    with pytest.raises(ValidationError):
        tp_shard(rank, size)


@pytest.mark.parametrize("bad", ["tp2of2", "tp0of1", "tp01of2", "tp-1of2", "tp0of02", "TP0OF2", "tp0of2 ", "rep", 3])
def test_shard_validation(bad):
    with pytest.raises(ValidationError):
        KVIdentity("m", "w", "bfloat16", 30, 3, 64, shard=bad)


def test_from_config():
    from runtime.config import RuntimeConfig

    cfg = RuntimeConfig(num_layers=30, num_kv_heads=3, head_dim=64, kv_dtype="bfloat16",
                        model_id="HuggingFaceTB/SmolLM2-135M", weight_version="main")
    assert KVIdentity.from_config(cfg) == IDENT
    assert KVIdentity.from_config(cfg.replace(tp_rank=3, tp_size=4)).shard == "tp3of4"


def test_cost_per_page_is_small():
    toks = np.arange(64 * 512, dtype=np.int32)
    best = min(_timed(lambda: page_hashes(toks, 64, "ns", IDENT)) for _ in range(5))
    assert best / 512 < 50e-6  # generous bound for noisy CI; measured ~1 us/page


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -- MLA (one latent per token) ------------------------------------------------------------

# DeepSeek-V3's geometry (61 layers, latent 512 + 64), the identity an MLA runtime has at any TP size
KNOWN_MLA = ["b51e39cd5e728fb56e85293eb890f290", "d90c2e7c040e5890b4f7fb381257214a", "7ff0d6922268057ee7b676d292b2542b"]


def test_known_vector_mla():
    mla = KVIdentity("deepseek-ai/DeepSeek-V3", "main", "bfloat16", 61, 1, 576, shard=REPLICATED, kv_layout="mla")
    assert [h.hex() for h in page_hashes(TOKENS, 16, "tenant-a", mla)] == KNOWN_MLA


def test_kv_layout_encoding_spec():
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<I", len(b)) + b

    head = s("m") + s("w") + s("bfloat16") + struct.pack("<QQQ", 30, 1, 64)
    assert KVIdentity("m", "w", "bfloat16", 30, 1, 64, kv_layout="mha").encode() == head
    assert KVIdentity("m", "w", "bfloat16", 30, 1, 64, kv_layout="mla").encode() == head + s("") + s("") + s("mla")
    assert (KVIdentity("m", "w", "bfloat16", 30, 1, 64, "L", REPLICATED, "mla").encode()
            == head + s("L") + s(REPLICATED) + s("mla"))


def test_mla_pages_never_match_mha_pages_of_the_same_bytes():
    """An MHA token of 1 head x 64 (K and V) has the bytes of an MLA latent of 128; and with the
    geometry equal too, the layout alone keeps the chains apart, at every shard."""
    mha = KVIdentity("m", "w", "bfloat16", 30, 1, 64)
    chains = [set(page_hashes(TOKENS, 16, None, ident)) for ident in (
        mha, KVIdentity("m", "w", "bfloat16", 30, 1, 128, kv_layout="mla"),
        KVIdentity("m", "w", "bfloat16", 30, 1, 64, kv_layout="mla"),
        KVIdentity("m", "w", "bfloat16", 30, 1, 64, shard=REPLICATED),
        KVIdentity("m", "w", "bfloat16", 30, 1, 64, shard=REPLICATED, kv_layout="mla"))]
    for i, a in enumerate(chains):
        assert all(not a & b for b in chains[i + 1:])


def test_from_config_mla_is_replicated_at_every_tp_size():
    from runtime.config import RuntimeConfig

    cfg = RuntimeConfig(num_layers=61, num_kv_heads=1, head_dim=576, kv_dtype="bfloat16", kv_layout="mla",
                        model_id="deepseek-ai/DeepSeek-V3", weight_version="main")
    one = KVIdentity.from_config(cfg)
    assert (one.shard, one.kv_layout) == (REPLICATED, "mla")
    assert all(KVIdentity.from_config(cfg.replace(tp_rank=r, tp_size=n)) == one for n in (2, 4, 8) for r in range(n))
    assert KVIdentity.from_config(cfg.replace(kv_layout="mha")).shard == ""


@pytest.mark.parametrize("bad", ["MLA", "", "gqa", 1])
def test_kv_layout_validation(bad):
    with pytest.raises(ValidationError):
        KVIdentity("m", "w", "bfloat16", 30, 1, 64, kv_layout=bad)


# -- the hash choice (RuntimeConfig.hash_algo) ---------------------------------------------------
def test_xxhash_chain_matches_the_documented_spec():
    """h(i) = XXH3-128(h(i-1) || page i's int32 tokens), seeded by SHA-256 of the seed bytes, whose
    identity names the algorithm (so no xxhash page ever shares a key with a SHA-256 one)."""
    import xxhash

    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<I", len(b)) + b

    ident = KVIdentity("HuggingFaceTB/SmolLM2-135M", "main", "bfloat16", 30, 3, 64, hash_algo="xxhash")
    assert ident.encode() == IDENT.encode() + s("") + s("") + s("mha") + s("xxhash")
    prev = hashlib.sha256(seed_bytes("tenant-a", ident)).digest()[:16]
    want = []
    for p in range(3):
        prev = xxhash.xxh3_128_digest(prev + struct.pack("<16i", *range(16 * p, 16 * p + 16)))
        want.append(prev)
    got = page_hashes(TOKENS, 16, "tenant-a", ident)
    assert got == want and not set(got) & set(page_hashes(TOKENS, 16, "tenant-a", IDENT))
    assert page_hashes(TOKENS[16:], 16, None, ident, parent=got[0]) == got[1:]  # (a parent continues it)


def test_hash_algo_is_validated_and_read_from_the_config():
    from runtime.config import RuntimeConfig
    from runtime.errors import ConfigError

    with pytest.raises(ValidationError):
        KVIdentity("m", "w", "bfloat16", 30, 1, 64, hash_algo="md5")
    with pytest.raises(ConfigError, match="hash_algo"):
        RuntimeConfig(hash_algo="xxh3")
    assert KVIdentity.from_config(RuntimeConfig(hash_algo="xxhash")).hash_algo == "xxhash"
    assert KVIdentity.from_config(RuntimeConfig()).hash_algo == "sha256"
