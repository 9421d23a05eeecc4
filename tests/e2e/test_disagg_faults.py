"""Faults between a decode runtime and its prefill peer (in one process, the in-process transport
with its fault hooks, the tiny model): a failed write, the decode side gone mid-transfer, a slow
peer, a lying peer (too many pages, wrong tags), a dropped connection. Every turn ends with the
same tokens as one runtime alone (the decode side computes what did not come), nothing leaks on
either side (both ledgers checked quiescent, every device slot free after a flush), and no wrong
KV is served (the tokens would differ)."""

from __future__ import annotations

import asyncio
import copy
import functools
import time

import numpy as np
import pytest

pytest.importorskip("transformers")

import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from runtime.disagg.peer_backend import PeerBackend  # noqa: E402
from runtime.disagg.prefill_server import PrefillServer  # noqa: E402
from runtime.disagg.protocol import Fill, Filled, Hello, Welcome, decode, encode  # noqa: E402
from runtime.disagg.transport import LocalTransport  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, greedy_generate_reference  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.invariants import check_invariants  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.storage.hashing import KVIdentity  # noqa: E402
from tests.e2e.support import ids, runtime_config  # noqa: E402

NEW = 6
DEADLINE_S = 20.0  # every turn ends (tokens, or an error) within this
config = functools.partial(runtime_config, device_slots=512, host_layout="page_first")
_names = iter(range(10**6))


def dconfig(model):
    return config(model, prefetch_policy="wait_complete", storage_timeout_s=1.0)


async def peer_for(endpoint: str, cfg, **kw) -> tuple[PeerBackend, LocalTransport]:
    transport = LocalTransport(f"decode-{next(_names)}")
    kw.setdefault("timeout_s", 0.5)
    kw.setdefault("cancel_grace_s", 0.5)
    kw.setdefault("dead_grace_s", 0.2)
    peer = await asyncio.to_thread(PeerBackend, endpoint, transport, KVIdentity.from_config(cfg), cfg.page_size,
                                   cfg.page_size * cfg.bytes_per_token, **kw)
    return peer, transport


async def clean(rt: CacheRuntime) -> None:
    """Nothing leaked: quiescent ledgers and tree, every device slot free after a flush."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while await rt.inspect(lambda core: core.in_flight()):
        assert loop.time() - t0 < 10, "copies or storage ops still in flight"
        await asyncio.sleep(0.01)
    await rt.inspect(lambda core: check_invariants(core, quiescent=True))
    await rt.flush()
    assert (await rt.available())["device_free"] == rt.config.device_slots


async def converse(drt: CacheRuntime, peer: PeerBackend, model, turns: int = 2, before_turn=None) -> None:
    """A conversation whose every turn must give a plain greedy run's tokens, in time."""
    history = ids(50, 3)
    async with ServingLoop(drt, PagedKVModel(model, drt.device_pool)) as loop:
        for turn in range(turns):
            history += ids(30, 20 + turn)
            if before_turn is not None:
                await before_turn(turn)
            peer.expect(history)
            t0 = time.monotonic()
            c = await asyncio.wait_for(loop.generate(history, max_new_tokens=NEW), DEADLINE_S)
            assert time.monotonic() - t0 < DEADLINE_S
            assert c.tokens == greedy_generate_reference(model, history, NEW), f"turn {turn}"
            history += c.tokens


async def run_pair(model, arrange, turns: int = 2, **peer_kw):
    """A prefill server and a decode runtime on it; `arrange(server, prefill_transport,
    decode_transport, turn)` sets up the fault before each turn. Returns both sides' stats."""
    cfg, dcfg = config(model), dconfig(model)
    ptransport = LocalTransport(f"prefill-{next(_names)}")
    async with CacheRuntime.open(cfg) as prt:
        server = PrefillServer(prt, PagedKVModel(copy.deepcopy(model), prt.device_pool), ptransport)
        async with server:
            peer, dtransport = await peer_for(server.endpoint, dcfg, **peer_kw)
            async with CacheRuntime.open(dcfg, storage=peer) as drt:
                await converse(drt, peer, model, turns,
                               lambda turn: arrange(server, ptransport, dtransport, turn))
                await clean(drt)
                dstats = (await drt.stats())["storage"]
            await clean(prt)
            return server.stats(), peer.counters, dstats


async def test_a_failed_write_leaves_the_decode_side_to_compute_it(model):
    async def arrange(server, pt, dt, turn):
        pt.fail_next = 1 if turn == 1 else 0
    sstats, pstats, _ = await run_pair(model, arrange)
    assert pstats["fill_failures"] == 1 and sstats["fill_failures"] == 1
    assert sstats["quarantined_pages"] > 0  # (the failed write's staging pages: never reused)


async def test_the_decode_side_gone_mid_transfer_leaks_nothing_on_the_prefill_side(model):
    async def arrange(server, pt, dt, turn):
        if turn == 1:  # the write waits, the decode side's endpoint closes under it
            pt.delay_s = 0.3
            asyncio.get_running_loop().call_later(0.1, setattr, dt, "closed", True)
    sstats, pstats, _ = await run_pair(model, arrange)
    assert sstats["fill_failures"] == 1 and pstats["fill_failures"] == 1


async def test_a_slow_peer_is_cancelled_or_waited_for_and_never_writes_into_freed_pages(model):
    """The write takes longer than the decode side waits: the cancel finds it writing, so the
    decode side waits for its answer (the read's pages stay pinned) and takes the late pages."""
    async def arrange(server, pt, dt, turn):
        pt.delay_s = 0.8 if turn == 1 else 0.0
    sstats, pstats, dstats = await run_pair(model, arrange, timeout_s=0.3, cancel_grace_s=2.0)
    assert pstats["fill_timeouts"] == 1 and pstats["fill_failures"] == 0 and sstats["fill_failures"] == 0
    assert dstats["rejected_pages"] == 0


async def test_a_dropped_connection_ends_every_turn(model):
    """The prefill server goes away after the first turn: the next fill is answered by no one, nor
    its cancel; the read fails after the grace and the decode side computes the turn."""
    async def arrange(server, pt, dt, turn):
        if turn == 1:
            await server.close()
    _sstats, pstats, _ = await run_pair(model, arrange)
    assert pstats["peer_silent"] == 1 and pstats["fill_timeouts"] == 1


class Liar:
    """A prefill peer that welcomes anyone and answers fills with `lie(fill)`, writing garbage
    into the destinations first (so that only the tags can tell)."""

    def __init__(self, lie, page_bytes: int) -> None:
        self.lie = lie
        self.transport = LocalTransport(f"liar-{next(_names)}")
        self.garbage = __import__("torch").full((64 * page_bytes,), 7, dtype=__import__("torch").uint8)
        self.transport.register(self.garbage)
        self.page_bytes = page_bytes
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.task = asyncio.create_task(self.serve())

    async def serve(self) -> None:
        while True:
            ident, payload = await self.sock.recv_multipart()
            msg = decode(payload)
            if isinstance(msg, Hello):
                await self.sock.send_multipart([ident, encode(Welcome(self.transport.session))])
            elif isinstance(msg, Fill):
                src = [self.garbage.data_ptr() + i * self.page_bytes for i in range(msg.pages)]
                await asyncio.to_thread(self.transport.write, msg.session, src, list(msg.dst_addrs),
                                        [self.page_bytes] * msg.pages)
                await self.sock.send_multipart([ident, encode(self.lie(msg))])

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)


@pytest.mark.parametrize("lie", ["too_many_pages", "wrong_tags"])
async def test_a_lying_peer_serves_no_wrong_kv(model, lie):
    dcfg = dconfig(model)
    page_bytes = dcfg.page_size * dcfg.bytes_per_token
    liar = Liar((lambda f: Filled(f.req, f.pages + 3, [bytes(16)] * (f.pages + 3))) if lie == "too_many_pages"
                else (lambda f: Filled(f.req, f.pages, [np.random.bytes(16) for _ in range(f.pages)])), page_bytes)
    try:
        peer, _ = await peer_for(liar.endpoint, dcfg)
        async with CacheRuntime.open(dcfg, storage=peer) as drt:
            await converse(drt, peer, model)
            await clean(drt)
            s = (await drt.stats())["storage"]
    finally:
        await liar.close()
    assert s["hit_tokens"] == 0  # nothing it sent was taken
    if lie == "wrong_tags":
        assert s["rejected_pages"] > 0
    else:
        assert peer.counters["fill_failures"] > 0
