"""State snapshot keys and chunking (`runtime.storage.state_blobs`) and their I/O against a file
backend (`runtime.transfer.state_io`)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from runtime.config import RuntimeConfig
from runtime.errors import LengthError, ValidationError
from runtime.memory.state_pool import StateComponent, StatePool, StateShape
from runtime.messages import StateBlob
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.storage.state_blobs import StateBlobFormat, encode_state_shape
from runtime.transfer.state_io import StateBlobIO

SHAPE = StateShape(2, (StateComponent("conv", (4, 3)), StateComponent("ssm", (2, 4, 8), torch.bfloat16)))
PAGE = bytes(range(16))


def test_known_keys():
    """Pinned: the encoding of the shape and the key derivation never change silently (stored
    snapshots of one version must be found by the next)."""
    fmt = StateBlobFormat.of(SHAPE, 64)
    assert (fmt.state_bytes, fmt.chunks) == (352, 6)
    assert fmt.state_id.hex() == "142f197789a6c1ed44266dbd19017e9a"
    assert [k.hex() for k in fmt.keys(PAGE)[:2]] == ["ba8594db6f8b92e9fe49396063e0291a",
                                                     "d04ec9db11d76bf9159af84f2b4b954d"]
    head = b"hicache-state-key-v1\x00" + PAGE + fmt.state_id
    assert fmt.keys(PAGE)[5] == hashlib.sha256(head + (5).to_bytes(4, "little") + (6).to_bytes(4, "little")).digest()[:16]


def test_keys_part_every_shape_dtype_page_and_chunk():
    other_dtype = StateShape(2, (StateComponent("conv", (4, 3)), StateComponent("ssm", (2, 4, 8), torch.float16)))
    other_dims = StateShape(2, (StateComponent("conv", (4, 3)), StateComponent("ssm", (2, 8, 4), torch.bfloat16)))
    other_layers = StateShape(3, SHAPE.components)
    other_name = StateShape(2, (StateComponent("conv", (4, 3)), StateComponent("ssm2", (2, 4, 8), torch.bfloat16)))
    shapes = [SHAPE, other_dtype, other_dims, other_layers, other_name]
    assert len({encode_state_shape(s) for s in shapes}) == len(shapes)
    keys = [k for s in shapes for k in StateBlobFormat.of(s, 64).keys(PAGE)]
    keys += StateBlobFormat.of(SHAPE, 64).keys(bytes(16))
    keys += StateBlobFormat.of(SHAPE, 128).keys(PAGE)  # another page size: another chunk count
    assert len(set(keys)) == len(keys)


def test_kv_page_hashes_do_not_depend_on_the_state():
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, device_slots=64)
    plain = RuntimeConfig(**base)
    hybrid = RuntimeConfig(**base, state_layers=2, state_components="conv:4x3:float32", state_slots=2)
    tokens = np.arange(16, dtype=np.int32)
    assert page_hashes(tokens, 4, None, KVIdentity.from_config(plain)) == \
        page_hashes(tokens, 4, None, KVIdentity.from_config(hybrid))


def test_split_pads_the_last_chunk_and_join_takes_it_back():
    fmt = StateBlobFormat.of(SHAPE, 64)
    data = np.random.default_rng(0).integers(0, 256, fmt.state_bytes, dtype=np.uint8)
    chunks = fmt.split(data)
    assert len(chunks) == 6 and all(c.shape == (64,) for c in chunks)
    assert not chunks[-1][352 - 5 * 64:].any()  # zero padding
    bufs = fmt.buffers()
    bufs[:] = np.stack(chunks)
    assert np.array_equal(fmt.join(bufs), data)
    with pytest.raises(LengthError):
        fmt.split(data[:-1])
    with pytest.raises(ValidationError):
        fmt.keys(PAGE[:8])
    with pytest.raises(ValidationError):
        StateBlobFormat(b"x" * 16, 0, 64)


def test_io_writes_finds_the_deepest_whole_and_reads_back(tmp_path):
    fmt = StateBlobFormat.of(SHAPE, 64)
    pool = StatePool(SHAPE, 4)
    for name, buf in pool.buffers.items():
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    io = StateBlobIO(pool, fmt)
    with FileBackend(str(tmp_path), 64) as fb:
        a, b = StateBlob(0, fmt.keys(b"a" * 16), 1), StateBlob(1, fmt.keys(b"b" * 16), 3)
        assert io.write(fb, [a, b]) == (True, True)
        la, lb = StateBlob(-1, (), 1, page=b"a" * 16), StateBlob(-1, (), 3, page=b"b" * 16)  # as the tree looks up
        # deepest first, within the KV found
        assert io.lookup(fb, [la, lb], found=3) == (False, True)
        assert io.lookup(fb, [la, lb], found=2) == (True, False)
        assert io.lookup(fb, [la, lb], found=0) == (False, False)
        fb.remove([b.keys[-1]])  # one chunk gone: the blob is not whole
        assert io.lookup(fb, [la, lb], found=3) == (True, False)
        into = StateBlob(2, a.keys, 1)
        assert io.read(fb, [into], read=1) == (True,)
        assert torch.equal(pool.read_slot(2), pool.read_slot(0))
        assert io.read(fb, [StateBlob(3, b.keys, 3)], read=3) == (False,)
        assert io.read(fb, [StateBlob(3, a.keys, 2)], read=1) == (False,)  # its KV was not read
