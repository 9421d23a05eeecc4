"""The serving loop's queue under interleaving: a turn submitted while the loop is admitting a
yielded request goes ahead of it in the queue; the admitted request must still be the one taken
off the queue (and the new turn kept). A stub runtime makes the interleaving deterministic:
its `can_admit` for the yielded request waits on a gate the test opens after the submit.

Checked against the broken variant (`popleft()` after the admit's awaits instead of removing the
admitted request): the new turn was dropped and the yielded request admitted twice
(`DuplicateRequestError`), so this test failed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from runtime.errors import DuplicateRequestError
from runtime.integrations.serving import ServingLoop
from runtime.messages import AdmitResult, Extend, Finish

PAGE = 4


class StubRuntime:
    """Room for `room` running requests; slots are handed out without any ledger. Each request's
    `extra_key` is its rid, so `can_admit` knows whom it is asked about."""

    def __init__(self, room: int) -> None:
        self.config = SimpleNamespace(device_slots=1024, page_size=PAGE, reuse_cost="always")
        self.room = room
        self.live: set = set()
        self.gate: tuple[str, asyncio.Event, asyncio.Event] | None = None  # (rid, asked, open)
        self.closed = False
        self._next = 0

    async def can_admit(self, tokens, extra_key=None) -> bool:
        if self.gate is not None and self.gate[0] == extra_key:
            _, asked, opened = self.gate
            self.gate = None
            asked.set()
            await opened.wait()
        return len(self.live) < self.room

    async def admit(self, rid, tokens, extra_key=None) -> AdmitResult:
        if rid in self.live:
            raise DuplicateRequestError(f"request {rid!r} is still live")
        self.live.add(rid)
        return AdmitResult(rid, 1, self._slots(len(tokens)), 0, 0, ())

    def _slots(self, n: int) -> torch.Tensor:
        out = torch.arange(self._next, self._next + n, dtype=torch.int32)
        self._next += n
        return out

    async def step(self, items):
        out = []
        for it in items:
            if isinstance(it, Extend):
                out.append(self._slots(1))
            else:
                if isinstance(it, Finish):
                    self.live.discard(it.rid)
                out.append(0)
        return out

    async def finish(self, rid, tokens) -> int:
        self.live.discard(rid)
        return 0

    async def abort(self, rid) -> None:
        self.live.discard(rid)


class StubModel:
    num_layers = 1

    def forward(self, seqs, before_layer=None):
        return SimpleNamespace(logits=torch.zeros(len(seqs), 8))  # greedy: token 0, never EOS


async def test_a_turn_submitted_during_an_admission_is_kept():
    rt = StubRuntime(room=1)
    async with ServingLoop(rt, StubModel(), max_running=4, yield_after=2) as srv:
        a = await srv.submit([1, 2, 3], max_new_tokens=20, rid="a", extra_key="a")
        while not srv._running or len(srv._running[0].generated) < 2:
            await asyncio.sleep(0)
        asked, opened = asyncio.Event(), asyncio.Event()
        rt.gate = ("a", asked, opened)
        # no room for b: a (past its quantum) yields to it and queues again, behind new turns
        b = await srv.submit([4, 5, 6], max_new_tokens=3, rid="b", extra_key="b")
        await asked.wait()  # the loop is admitting a: c arrives meanwhile and goes ahead of it
        c = await srv.submit([7, 8, 9], max_new_tokens=3, rid="c", extra_key="c")
        rt.room = 2
        opened.set()
        done = await asyncio.wait_for(asyncio.gather(a, b, c), timeout=10)
    assert [len(d.tokens) for d in done] == [20, 3, 3]
    assert done[0].metrics.yields >= 1 and srv.stats["yields"] >= 1
