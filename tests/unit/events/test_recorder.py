"""The recorder names pages by the storage tier's page hashes, through splits and extended leaves,
and a flush that empties both tiers is one `AllBlocksCleared` (the core built directly, no loop)."""

from __future__ import annotations

import numpy as np

from runtime.config import RuntimeConfig
from runtime.events.recorder import materialize
from runtime.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.tree.cache import CacheCore
from tests.tokens import toks

PS = 4


def core(**changes) -> CacheCore:
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=PS, device_slots=64, host_tokens=0,
                kv_events=True)
    base.update(changes)
    c = CacheCore(RuntimeConfig(**base))
    c.enable_events()
    return c


def hashes(config: RuntimeConfig, tokens, extra_key=None) -> list[bytes]:
    return page_hashes(np.asarray(tokens, dtype=np.int32), config.page_size, extra_key, KVIdentity.from_config(config))


def events_of(c: CacheCore) -> list:
    return materialize(c.take_events(), c.page_size)


def stored(events, medium="GPU") -> list[BlockStored]:
    return [e for e in events if type(e) is BlockStored and e.medium == medium]


def test_stored_pages_carry_the_storage_hashes_tokens_and_parent():
    c = core()
    a = toks(16, 1)
    c.admit("a", a, extra_key="t1")
    c.finish("a", a)
    (ev,) = stored(events_of(c))
    want = hashes(c.config, a, "t1")
    assert ev.block_hashes == want and ev.parent_block_hash is None
    assert ev.token_ids == a.tolist() and ev.block_size == PS
    assert ev.extra_keys == [("t1",)] * 4


def test_a_split_moves_hashes_with_the_pages():
    c = core()
    a = toks(20, 2)
    b = np.concatenate((a[:8], toks(12, 3)))  # shares two pages with a, then splits its node
    for rid, t in (("a", a), ("b", b)):
        c.admit(rid, t)
        c.finish(rid, t)
    events = events_of(c)
    new = stored(events)[1]
    want_b = hashes(c.config, b)
    assert new.block_hashes == want_b[2:5] and new.parent_block_hash == want_b[1]
    # evict everything: every removal names the pages by their own hashes
    c.flush()
    c.admit("c", toks(8, 9))  # (keeps the tree non-empty is not needed: the flush emptied it)
    events = events_of(c)
    assert AllBlocksCleared() in events


def test_removals_after_a_split_name_the_right_pages():
    c = core(device_slots=48)
    a = toks(20, 4)
    b = np.concatenate((a[:8], toks(12, 5)))
    for rid, t in (("a", a), ("b", b)):
        c.admit(rid, t)
        c.finish(rid, t)
    # a request on a's first page locks it (a split at 4 tokens): the flush cannot empty the tiers
    c.admit("keep", np.concatenate((a[:4], toks(4, 6))))
    events_of(c)
    c.flush()
    events = events_of(c)
    removed = [h for e in events if type(e) is BlockRemoved for h in e.block_hashes]
    assert AllBlocksCleared() not in events
    assert sorted(removed) == sorted(hashes(c.config, a)[1:5] + hashes(c.config, b)[2:5])


def test_an_extended_leaf_reports_only_its_new_pages():
    c = core()
    a = toks(9, 7)
    res = c.admit("s", a)
    c.cache("s", a)
    first = stored(events_of(c))
    c.extend("s", 8)
    longer = np.concatenate((a, toks(8, 8)))
    c.cache("s", longer)
    (ev,) = stored(events_of(c))
    want = hashes(c.config, longer)
    assert [h for e in first for h in e.block_hashes] == want[:2]
    assert ev.block_hashes == want[2:4] and ev.parent_block_hash == want[1]
    assert ev.token_ids == longer[8:16].tolist()
    assert res.rid == "s"


def test_events_off_records_nothing():
    c = CacheCore(RuntimeConfig(num_layers=2, num_kv_heads=2, head_dim=8, page_size=PS, device_slots=64, host_tokens=0))
    a = toks(16, 1)
    c.admit("a", a)
    c.finish("a", a)
    assert events_of(c) == []
