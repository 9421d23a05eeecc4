"""Prefill/decode disaggregation in one process (the demo's tiny model, the in-process transport):
a decode runtime whose storage tier reads from a prefill runtime (`PeerBackend` ->
`PrefillServer`) gives the same greedy tokens as one runtime alone, turn after turn, and the
prefill side writes only the pages the decode side's tiers do not hold. Two processes over
Mooncake's Transfer Engine: tests/e2e/test_disagg_processes.py."""

from __future__ import annotations

import asyncio
import copy
import functools

import pytest

pytest.importorskip("transformers")

from runtime.disagg.peer_backend import PeerBackend  # noqa: E402
from runtime.disagg.prefill_server import PrefillServer  # noqa: E402
from runtime.disagg.transport import LocalTransport  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, greedy_generate_reference  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.storage.hashing import KVIdentity  # noqa: E402
from tests.e2e.support import PAGE, ids, runtime_config  # noqa: E402

NEW = 8
config = functools.partial(runtime_config, device_slots=512, host_layout="page_first")


async def open_peer(server: PrefillServer, cfg, name: str, **kw) -> PeerBackend:
    """The decode side's backend (its Hello blocks: off the loop the server answers on)."""
    return await asyncio.to_thread(PeerBackend, server.endpoint, LocalTransport(name), KVIdentity.from_config(cfg),
                                   cfg.page_size, cfg.page_size * cfg.bytes_per_token, **kw)


async def chat(loop: ServingLoop, peer: PeerBackend, model, turns: int) -> list[tuple[int, int, int]]:
    """Turns of one conversation; per turn (delta pages the decode side lacked, pages sent, tokens
    matched on the decode side). Every turn's tokens must equal a plain greedy run's."""
    history = ids(50, 1)
    out = []
    for turn in range(turns):
        history += ids(30, 10 + turn)
        before = peer.counters["pages_filled"]
        peer.expect(history)
        c = await loop.generate(history, max_new_tokens=NEW)
        assert c.tokens == greedy_generate_reference(model, history, NEW), f"turn {turn}"
        m = c.metrics
        matched = m.device_tokens + m.host_tokens
        lacked = (len(history) - 1) // PAGE - matched // PAGE
        out.append((lacked, peer.counters["pages_filled"] - before, matched))
        history += c.tokens
    return out


async def test_decode_equals_one_runtime_and_the_prefill_side_sends_only_the_delta(model):
    cfg = config(model)
    dcfg = config(model, prefetch_policy="wait_complete", storage_timeout_s=30.0)
    async with CacheRuntime.open(cfg) as prt, \
            PrefillServer(prt, PagedKVModel(copy.deepcopy(model), prt.device_pool), LocalTransport("p1")) as server:
        peer = await open_peer(server, dcfg, "d1")
        async with CacheRuntime.open(dcfg, storage=peer) as drt, \
                ServingLoop(drt, PagedKVModel(model, drt.device_pool)) as loop:
            turns = await chat(loop, peer, model, 4)
            s = (await drt.stats())["storage"]
        assert server.stats()["fills"] >= 4 and server.stats()["quarantined_pages"] == 0
        # the peer stores nothing (`read_only`): the tier issues no write-through to it at all
        assert s["writes_issued"] == 0 and s["ops_skipped"] == 0 and s["health"] == "healthy", s
    lacked = sum(t[0] for t in turns)
    sent = sum(t[1] for t in turns)
    assert sent == lacked > 0, turns  # exactly the delta
    assert all(t[2] > 0 for t in turns[1:]), turns  # later turns matched on the decode side


async def test_a_restarted_decode_side_reads_its_storage_first_and_asks_the_peer_for_the_rest(model, tmp_path):
    """Decode side with a file storage tier too (`StorageThenPeer`): its write-through keeps the
    conversation; a fresh decode runtime on the same directory reads the history from storage and
    asks the prefill peer only for the pages after it; tokens equal one runtime's."""
    from runtime.disagg.chained import StorageThenPeer
    from runtime.storage.file_backend import FileBackend

    cfg = config(model)
    dcfg = config(model, prefetch_policy="wait_complete", storage_timeout_s=30.0, write_policy="write_through")
    page_bytes = dcfg.page_size * dcfg.bytes_per_token
    history = ids(70, 5)
    async with CacheRuntime.open(cfg) as prt, \
            PrefillServer(prt, PagedKVModel(copy.deepcopy(model), prt.device_pool), LocalTransport("p2")) as server:
        sent = []
        for life in range(2):  # the decode process, then its restart
            peer = await open_peer(server, dcfg, f"d2-{life}")
            backend = StorageThenPeer(FileBackend(tmp_path / "store", page_bytes), peer)
            async with CacheRuntime.open(dcfg, storage=backend) as drt, \
                    ServingLoop(drt, PagedKVModel(model, drt.device_pool)) as loop:
                history += ids(30, 40 + life)
                backend.expect(history)
                c = await loop.generate(history, max_new_tokens=NEW)
                assert c.tokens == greedy_generate_reference(model, history, NEW), f"life {life}"
                history += c.tokens
                sent.append((peer.counters["pages_filled"], c.metrics.storage_tokens, (len(history) - NEW - 1) // PAGE))
                await drt.flush()  # (backups and their write-through settle before the close)
    (first, _, pages0), (again, from_tiers, pages1) = sent
    assert first == pages0  # nothing held: all from the peer
    assert from_tiers // PAGE == pages1 and again < pages1 - pages0 + 2, sent  # storage first, the peer the rest


async def test_concurrent_conversations_on_one_peer_never_block_the_loop(model):
    """Conversations announce their prompts (`expect`, on the event loop) while another's fill is
    in flight (its worker thread waits on the peer): with the prefill server on the same loop, an
    `expect` that waited for the fill's lock would wait for the server it blocks. (Checked failing
    with `expect` taking the request lock, as it first did: every fill timed out, then the peer
    was taken for gone.)"""
    cfg = config(model)
    dcfg = config(model, prefetch_policy="wait_complete", storage_timeout_s=30.0)
    async with CacheRuntime.open(cfg) as prt, \
            PrefillServer(prt, PagedKVModel(copy.deepcopy(model), prt.device_pool), LocalTransport("p3")) as server:
        peer = await open_peer(server, dcfg, "d3", timeout_s=5.0, dead_grace_s=0.1)
        async with CacheRuntime.open(dcfg, storage=peer) as drt, \
                ServingLoop(drt, PagedKVModel(model, drt.device_pool)) as loop:

            async def conv(u: int) -> None:
                history = ids(200, 100 + u)
                for turn in range(2):
                    history += ids(60, 200 + 10 * u + turn)
                    peer.expect(history)
                    c = await asyncio.wait_for(loop.generate(history, max_new_tokens=NEW), 30)
                    assert c.tokens == greedy_generate_reference(model, history, NEW), (u, turn)
                    history += c.tokens

            await asyncio.gather(*(conv(u) for u in range(4)))
    assert peer.counters["fill_timeouts"] == 0 and peer.counters["fills"] >= 4
