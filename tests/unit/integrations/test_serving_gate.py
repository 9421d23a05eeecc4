"""The serving loop's layer gate picks its path: on CUDA (every layer of every load has its copy
event) the forward's stream waits on the events (`stream.wait_event`) and nothing on the host
waits; otherwise (a CPU model, a copy not issued yet) the per-layer awaitables are bridged to the
forward's thread. Fake events and a fake stream stand in for CUDA's."""

from __future__ import annotations

import asyncio

import pytest

from runtime.integrations.serving import _EventGate, _LayerGate, _layer_gate

LAYERS = 3


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[str] = []

    def wait_event(self, ev: FakeEvent) -> None:
        self.waited.append(ev.name)


class FakeReadiness:
    def __init__(self, name: str, with_events: bool) -> None:
        self.events = [FakeEvent(f"{name}{i}") for i in range(LAYERS)] if with_events else None
        self.futs = [asyncio.get_running_loop().create_future() for _ in range(LAYERS)]

    def event(self, layer: int):
        return None if self.events is None else self.events[layer]

    async def wait(self, layer: int) -> None:
        await asyncio.shield(self.futs[layer])


async def test_on_cuda_the_stream_waits_on_each_layers_events():
    loads = [FakeReadiness("a", True), FakeReadiness("b", True)]
    stream = FakeStream()
    gate = _layer_gate(loads, LAYERS, lambda: stream)
    assert isinstance(gate, _EventGate)
    # never blocks, though no layer's future is done: the GPU orders the work
    await asyncio.wait_for(asyncio.to_thread(gate.before_layer, 0), 2)
    gate.before_layer(2)
    assert stream.waited == ["a0", "b0", "a2", "b2"] and gate.wait_s == 0.0
    gate.close()


@pytest.mark.parametrize("events", [(False,), (True, False)])
async def test_without_every_event_the_awaitables_gate_the_forward(events):
    loads = [FakeReadiness(str(i), e) for i, e in enumerate(events)]
    stream = FakeStream()
    gate = _layer_gate(loads, LAYERS, lambda: stream)
    assert isinstance(gate, _LayerGate)
    forward = asyncio.create_task(asyncio.to_thread(gate.before_layer, 0))
    await asyncio.sleep(0.05)
    assert not forward.done()  # layer 0 not ready: the forward's thread waits
    for rd in loads:
        rd.futs[0].set_result(None)
    await asyncio.wait_for(forward, 2)
    assert stream.waited == []
    gate.close()
