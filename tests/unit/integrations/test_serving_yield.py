"""The serving loop's yields cost no recompute the cache could have saved: a decode yields only
when its written KV ends on a page boundary (the cache keeps whole pages: a yield mid-page made
its resume recompute the page's tail), and a yielded request is passed by at most `max_running`
new turns (one left behind every later turn lost its cached KV to eviction and recomputed all).
Both failed with the loop as it was: the yield came at 6 written tokens, and every new turn went
ahead of the yielded request."""

from __future__ import annotations

import asyncio

from runtime.integrations.serving import ServingLoop, TurnMetrics, _Request
from tests.unit.integrations.test_serving_queue import PAGE, StubModel, StubRuntime


class FinishSpy(StubRuntime):
    def __init__(self, room: int) -> None:
        super().__init__(room)
        self.finished: list[tuple[str, int]] = []

    async def finish(self, rid, tokens) -> int:
        self.finished.append((rid, len(tokens)))
        return await super().finish(rid, tokens)


async def test_a_decode_yields_only_at_a_page_boundary():
    rt = FinishSpy(room=1)
    async with ServingLoop(rt, StubModel(), max_running=4, yield_after=2) as srv:
        # 5 prompt tokens: its quantum (2 tokens) is reached with 6 written, the next page ends at 8
        a = await srv.submit([1, 2, 3, 4, 5], max_new_tokens=12, rid="a", extra_key="a")
        while not srv._running or len(srv._running[0].generated) < 2:
            await asyncio.sleep(0)
        b = await srv.submit([6, 7, 8], max_new_tokens=2, rid="b", extra_key="b")
        done = await asyncio.wait_for(asyncio.gather(a, b), timeout=10)
    assert done[0].metrics.yields >= 1
    yields = [n for rid, n in rt.finished if rid == "a"]
    assert yields and all(n % PAGE == 0 for n in yields), rt.finished


async def test_a_yielded_request_is_passed_by_at_most_max_running_new_turns():
    srv = ServingLoop(StubRuntime(room=1), StubModel(), max_running=2)  # (never started)
    loop = asyncio.get_running_loop()

    def request(rid: str) -> _Request:
        return _Request(rid, [1], 1, frozenset(), None, loop.create_future(), 0.0, TurnMetrics(rid))

    yielded = request("y")
    yielded.yield_room()
    srv._enqueue(yielded)
    for rid in ("n1", "n2", "n3", "n4"):
        srv._enqueue(request(rid))
    assert [r.rid for r in srv._waiting] == ["n1", "n2", "y", "n3", "n4"]
