"""PrefixIndex: per-instance residency from events alone; device, then host, then storage runs."""

from __future__ import annotations

from runtime.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, PrefixHit, PrefixIndex

H = [bytes([i]) * 16 for i in range(8)]


def stored(hashes, medium):
    return BlockStored(hashes, None, [0] * len(hashes), 1, None, medium, None)


def test_match_is_device_then_host_then_storage_runs():
    ix = PrefixIndex()
    ix.apply("a", KVEventBatch(0.0, [stored(H[:2], "GPU"), stored(H[:4], "CPU"), stored(H[4:6], "STORAGE")]))
    assert ix.match("a", H) == PrefixHit(2, 2, 2)
    ix.apply("a", KVEventBatch(1.0, [BlockRemoved([H[1]], "GPU")]))
    assert ix.match("a", H) == PrefixHit(1, 3, 2)  # host holds page 1 too: the run goes on there


def test_shared_storage_is_everybody_s_and_survives_a_clear():
    ix = PrefixIndex(shared_storage=True)
    ix.apply("a", KVEventBatch(0.0, [stored(H[:3], "STORAGE"), stored(H[:1], "GPU")]))
    assert ix.match("b", H) == PrefixHit(0, 0, 3)  # never heard of b: storage is shared
    ix.apply("a", KVEventBatch(1.0, [AllBlocksCleared()]))
    assert ix.match("a", H) == PrefixHit(0, 0, 3)
    assert ix.pages("a", "GPU") == frozenset()


def test_private_storage_and_forget():
    ix = PrefixIndex(shared_storage=False)
    ix.apply("a", KVEventBatch(0.0, [stored(H[:3], "STORAGE")]))
    assert ix.match("b", H) == PrefixHit(0, 0, 0) and ix.match("a", H) == PrefixHit(0, 0, 3)
    ix.forget("a")
    assert ix.match("a", H) == PrefixHit(0, 0, 0) and ix.instances() == []
