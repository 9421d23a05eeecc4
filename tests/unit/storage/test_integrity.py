"""Page tags (`PageSeal`) and the storage tier's check (`write_pages`, `read_prefix`, `read_pages`)
over the file backend: what is refused, counted, removed and rewritten."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from runtime.errors import ConfigError
from runtime.storage.backend import FaultyBackend, read_pages, read_prefix, write_pages
from runtime.storage.file_backend import FileBackend
from runtime.storage.integrity import TAG_BYTES, PageSeal

PB = 4096
KEY = "a storage key of 32 bytes ......"


def key(i: int, tag: str = "k") -> bytes:
    return f"{tag}{i:06d}".encode().ljust(16, b".")


def page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PB, dtype=np.uint8)


@pytest.fixture
def fb(tmp_path):
    b = FileBackend(tmp_path / "s", PB)
    yield b
    b.close()


def flip_stored_byte(fb: FileBackend, k: bytes, at: int = PB // 3) -> None:
    with open(fb._path(k)[2], "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_tags_bind_the_payload_and_the_key_in_both_modes():
    p = page(1)
    for seal in (PageSeal(), PageSeal(KEY)):
        t = seal.tag(b"key-a", p)
        assert len(t) == TAG_BYTES
        assert t == seal.tag(b"key-a", p.copy()) == seal.tag(b"key-a", torch.from_numpy(p.copy()))
        assert t == seal.tag(b"key-a", torch.from_numpy(p.copy()).view(torch.bfloat16))  # any dtype: its bytes
        assert t != seal.tag(b"key-b", p)
        q = p.copy()
        q[7] ^= 1
        assert t != seal.tag(b"key-a", q)
    # unkeyed: XXH3-128 seeded by the key (anyone can compute it); keyed: not without the key
    assert PageSeal().tag(b"key-a", p) == xxhash.xxh3_128_digest(p, seed=xxhash.xxh3_64_intdigest(b"key-a"))
    assert PageSeal(KEY).tag(b"key-a", p) not in (PageSeal().tag(b"key-a", p),
                                                  PageSeal(KEY + "x").tag(b"key-a", p))
    assert PageSeal(KEY).tag(b"key-a", p) == PageSeal(KEY.encode()).tag(b"key-a", p)
    with pytest.raises(ConfigError) as err:
        PageSeal("too short")
    assert "too short" not in str(err.value)


def test_a_flipped_stored_byte_is_refused_counted_removed_and_rewritten(fb):
    """One payload byte flipped in a stored page file: `read_prefix` ends before it, `read_pages`
    misses it alone; each refusal counted by the seal, and the file removed, so that the next
    write stores the page again. With the check disabled (`PageSeal.check` always True) this
    fails at the first read: the flipped page is served."""
    seal = PageSeal()
    keys = [key(i, "flip") for i in range(3)]
    assert write_pages(fb, keys, [page(i) for i in range(3)], seal) == (True,) * 3
    flip_stored_byte(fb, keys[1])
    dests = [np.zeros(PB, np.uint8) for _ in keys]
    assert read_prefix(fb, keys, dests, seal) == 1 and seal.rejected == 1
    assert fb.exists_prefix(keys) == 1  # removed
    assert write_pages(fb, keys, [page(i) for i in range(3)], seal) == (True,) * 3
    assert read_prefix(fb, keys, dests, seal) == 3
    assert all(np.array_equal(dests[i], page(i)) for i in range(3))
    flip_stored_byte(fb, keys[0])
    assert read_pages(fb, keys, dests, seal) == (False, True, True) and seal.rejected == 2
    # the exists_prefix + get_batch path (a backend without get_prefix) checks the same way
    assert write_pages(fb, keys[:1], [page(0)], seal) == (True,)
    flip_stored_byte(fb, keys[2])
    assert read_prefix(FaultyBackend(fb), keys, dests, seal) == 2 and seal.rejected == 3


def test_a_page_copied_under_another_key_is_refused(fb):
    """Page A's file (payload and tag) copied under key B's name: the tag is bound to A's key, so B
    is refused. With the check disabled this fails: B serves A's bytes."""
    seal = PageSeal()
    a, b = key(1, "forgeA"), key(2, "forgeB")
    assert write_pages(fb, [a], [page(1)], seal) == (True,)
    with open(fb._path(b)[2], "wb") as f:
        f.write(open(fb._path(a)[2], "rb").read())
    d = np.zeros(PB, np.uint8)
    assert fb.get_batch([b], [d]) == [True]  # the backend hands it over ...
    assert read_prefix(fb, [b], [d], seal) == 0 and seal.rejected == 1  # ... the tier refuses it
    assert read_prefix(fb, [a], [d], seal) == 1 and np.array_equal(d, page(1))  # A itself is intact


def test_with_a_key_pages_tagged_without_it_are_refused_and_replaced(fb):
    """A forger with write access to the directory writes pages of the right layout under the
    right keys, tagged unkeyed or under another key: a reader with the key refuses all of them
    (0 served, each counted), and its own write of a key replaces the forged file. With the
    reader's seal unkeyed (the key ignored) this fails: the unkeyed forgery is served."""
    reader = PageSeal(KEY)
    keys = [key(i, "mac") for i in range(40)]
    for forger in (PageSeal(), PageSeal("some other key, long enough")):
        fb.remove(keys)
        assert write_pages(fb, keys, [page(100 + i) for i in range(40)], forger) == (True,) * 40
        before = reader.rejected
        served = sum(read_pages(fb, [k], [np.zeros(PB, np.uint8)], reader)[0] for k in keys)
        assert served == 0 and reader.rejected - before == 40
    # the rightful writer's pages replace the forged files (a present page with another tag is not this page)
    assert write_pages(fb, keys[:1], [page(0)], reader) == (True,)  # (removed by the refusal anyway)
    fb.remove(keys[1:2])
    assert write_pages(fb, keys[1:2], [page(101)], PageSeal()) == (True,)  # a forged file is there ...
    assert write_pages(fb, keys[1:2], [page(1)], reader) == (True,)  # ... and replaced
    d = [np.zeros(PB, np.uint8), np.zeros(PB, np.uint8)]
    assert read_prefix(fb, keys[:2], d, reader) == 2 and np.array_equal(d[1], page(1))
    assert fb.used_bytes() == 2 * fb.file_bytes  # a replaced file leaves the accounting exact
