"""KV events through the runtime: a ZMQ subscriber on 127.0.0.1 rebuilds, from the events alone, an
index whose longest-prefix answer equals `match_prefix` per tier (and storage's pages) after a
randomized workload with evictions, load-backs, storage writes and a flush; the subscriber joins
late and fills the gap from the replay endpoint; in-process subscriptions end at close.

The planted variant `split_keeps_page_hashes` (tests/fuzz/planted.py) shows the fuzzer's
events oracle (`Driver.check_events`) fails when a split leaves the hashes with the wrong part;
here, replacing `Residency.drop_device`'s removal event by nothing made
`test_zmq_index_equals_match_prefix` fail (device pages announced but not held).
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from runtime.errors import ArgumentError, CapacityError, ConfigError, StateError
from runtime.events import CPU, GPU, STORAGE, EventsLostError, PrefixIndex
from runtime.events.subscriber import ZmqEventSubscriber
from runtime.runtime import CacheRuntime
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, page_hashes
from tests.integration.support import compute, settle, small_config, toks


async def consume(sub: ZmqEventSubscriber, index: PrefixIndex, seen: list[int]) -> None:
    async for seq, batch in sub:
        index.apply("rt", batch)
        seen.append(seq)


@pytest.mark.parametrize("hash_algo", ["sha256", "xxhash"])
async def test_zmq_index_equals_match_prefix(tmp_path, hash_algo):
    """Events and storage name a page by the same hash, whichever the configured one is."""
    config = small_config(device_slots=96, host_tokens=192, copy_engine="cpu", kv_events=True,
                          kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*",
                          hash_algo=hash_algo)
    storage = FileBackend(str(tmp_path), config.page_size * config.bytes_per_token)
    rng = random.Random(5)
    systems = [toks(12, 100 + i) for i in range(3)]
    prompts = [np.concatenate((rng.choice(systems), toks(rng.randint(2, 30), 200 + i))) for i in range(24)]
    async with CacheRuntime.open(config, storage=storage) as rt:
        pub, replay = rt.kv_events_endpoints
        assert pub.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")

        async def serve(rid, tokens):
            try:
                res = await rt.admit(rid, tokens)
            except CapacityError:
                return
            await rt.inspect(lambda core: None)  # loads started by the admit land before compute
            await settle(rt)
            compute(rt, res.slots, tokens)
            await rt.finish(rid, tokens)

        for i in range(6):  # before anyone subscribes: the subscriber must replay these
            await serve(f"early{i}", prompts[i])
        index, seen = PrefixIndex(shared_storage=False), []
        sub = ZmqEventSubscriber(pub, replay_endpoint=replay)
        reader = asyncio.create_task(consume(sub, index, seen))
        try:
            for i in range(160):
                await serve(f"r{i}", rng.choice(prompts))
                if i == 80:
                    await settle(rt)
                    await rt.flush()
            await settle(rt)
            stats = await rt.stats()
            last = rt._events.next_seq - 1
            for _ in range(2000):
                if seen and seen[-1] == last:
                    break
                await asyncio.sleep(0.005)
            assert seen == list(range(last + 1)), "batches missing or out of order"
            # the workload did what the test claims
            assert stats["device"]["evicted_tokens"] > 0 and stats["host"]["hit_tokens"] > 0
            assert stats["storage"]["written_pages"] > 0
            assert stats["events"]["batches"] == last + 1 and stats["events"]["dropped_batches"] == 0
            identity = KVIdentity.from_config(config)
            ps = config.page_size
            for tokens in prompts + [toks(40, 999)]:
                want = await rt.match_prefix(tokens)
                hit = index.match("rt", page_hashes(tokens, ps, None, identity))
                assert (hit.device * ps, hit.host * ps) == (want["device"], want["host"])
            known = await rt.inspect(lambda core: frozenset(core.storage.known))
            assert index.pages("rt", STORAGE) == known and known
            assert index.pages("rt", GPU) and index.pages("rt", CPU)
        finally:
            reader.cancel()
            sub.close()
    storage.close()


async def test_in_process_subscription_sees_flush_and_ends_at_close():
    async with CacheRuntime.open(small_config(kv_events=True, host_tokens=0)) as rt:  # (no backup lands later)
        sub = rt.kv_events()
        t = toks(16, 1)
        res = await rt.admit("a", t)
        compute(rt, res.slots, t)
        await rt.finish("a", t)
        await rt.flush()
    batches = [b async for b in sub]
    kinds = [type(e).__name__ for b in batches for e in b.events]
    assert kinds[-1] == "AllBlocksCleared" and "BlockStored" in kinds
    assert all(b.ts > 0 for b in batches)


async def test_a_subscription_that_falls_behind_is_cut_off_not_stalled():
    async with CacheRuntime.open(small_config(kv_events=True)) as rt:
        sub = rt.kv_events(maxsize=2)
        for i in range(4):
            t = toks(8, 10 + i)
            await rt.admit(f"a{i}", t)
            await rt.finish(f"a{i}", t)
        with pytest.raises(EventsLostError):
            async for _ in sub:
                pass


async def test_event_calls_validate():
    async with CacheRuntime.open(small_config()) as rt:
        with pytest.raises(StateError):
            rt.kv_events()
        assert rt.kv_events_endpoints == (None, None)
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        small_config(kv_events_endpoint="tcp://127.0.0.1:*")
    with pytest.raises(ConfigError, match="ZMQ endpoint"):
        small_config(kv_events=True, kv_events_endpoint="127.0.0.1:5557")
    async with CacheRuntime.open(small_config(kv_events=True)) as rt:
        with pytest.raises(ArgumentError, match="maxsize"):
            rt.kv_events(maxsize=0)
