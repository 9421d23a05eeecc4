"""Differential test of the sliding-window adapter through the runtime: concurrent multi-turn
conversations (tiny random Gemma 3 text model: sliding, sliding, full, sliding layers, window
20; fp32) through a ``ServingLoop`` over a runtime with a small device pool, a host pool and a
file storage tier. Every turn's greedy tokens equal transformers' own ``generate`` with no reuse
and every step's logits are within 1e-5 (``test_differential_tiers.mismatches``). Every
prompt is longer than the window, so the sliding layers of every forward see a window that
starts after position 0.

Turns run in lockstep; between them the copies settle, then
- after turn 0: nothing, so turn 1 hits its history on device;
- after turn 1: a filler request as long as the device pool evicts the conversations' nodes
  (write-through: their host copies stay), so turn 2 loads its history back from host;
- after turn 2: ``flush`` drops device and host, so turn 3 prefetches it from storage.

The window rule through the runtime: the same run with the K/V of every position before each
forward's window start (``start - W + 1``) replaced by NaN in the sliding layers during that
forward still equals ``generate``; with one slot zeroed for good at the window's first position
(SWA KV dropped inside the window) every turn fails. The NaN is put back after each forward:
dropping, for good, everything before a request's own window breaks the next turn, whose hit
ends at a page boundary (e.g. at 32 after a turn that computed up to 45) and so needs positions
13..31 that the previous turn's last forward no longer did. What a cached prefix of length n
needs is the last W - 1 positions before n, for every n a match can end at.

The runtime's sliding pool (``sliding_layers``: the rule of docs/ARCHITECTURE.md, "Pool groups"):
the same conversations through a runtime whose sliding layers have a pool of their own, too small
for every cached page (``SWA_TOKENS``), so the tree drops sliding KV outside every node end's
window and cuts hits back to present windows; every turn still equals ``generate``, with drops and
device hits both > 0, device-only and with a host tier (write-through; write-back, whose backups
come after drops, so host copies lack some sliding KV and loads bring back only what they have),
host loads > 0. The broken variant, a drop rule that keeps one page less than the last W - 1
tokens before each node end (so it drops inside the window), makes the same run fail: the
adapter's window then reads a dropped slot (``LookupError``), checked by
``test_swa_drop_inside_the_window_is_caught`` (run without the invariant checker, which flags the
same drop first).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

pytest.importorskip("transformers")

from runtime.integrations.hf_llama import PagedOutput, PagedSeq  # noqa: E402
from runtime.integrations.hf_swa import PagedSWAModel, sliding_layers, swa_config, tiny_gemma3  # noqa: E402
from runtime.integrations.serving import ServingError, ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.tree.groups.sliding import SlidingWindow  # noqa: E402
from tests.e2e.support import DEVICE, PAGE, ids, runtime_config  # noqa: E402
from tests.e2e.test_differential_tiers import SYSTEM, evict_to_host, mismatches, serve_turns, settle  # noqa: E402

WINDOW = 20  # the conversations' shared system prompt (40 tokens) is already longer
TURNS = 4
DEVICE_SLOTS = 640  # the last turn's three running conversations and little more
SWA_TOKENS = 288  # the sliding pool: the running conversations' windows, not every cached page (at 352 the
# run drops too, but the broken rule's extra drops then miss every window read: small enough to bite)


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3(seed=0, window=WINDOW).to(DEVICE)


@pytest.fixture(scope="module")
def ref_model(model):
    import copy

    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")  # transformers' own attention, masks and sliding-window cache
    return ref


class PoolEdit:
    """The adapter driven with a planted edit of its sliding layers' K/V before each forward."""

    def __init__(self, inner: PagedSWAModel) -> None:
        self.inner, self.num_layers = inner, inner.num_layers
        self.layers = sorted(sliding_layers(inner.model))
        self.edited = 0  # slots edited, over all forwards

    def loaded(self, kw: dict) -> dict:
        """Waits for every layer's host->device load before the edit (a load still in flight
        would overwrite it, or be overwritten by a restore); the forward then waits no more."""
        before_layer = kw.pop("before_layer", None)
        if before_layer is not None:
            for layer in range(self.num_layers):
                before_layer(layer)
        return kw

    def slots(self, seq: PagedSeq, positions: range) -> torch.Tensor:
        return torch.as_tensor(seq.slots, dtype=torch.long)[positions.start : positions.stop]

    def fill(self, slots: torch.Tensor, value: float) -> None:
        self.edited += slots.numel()
        for layer in self.layers:
            self.inner.pool.k[layer][slots] = value
            self.inner.pool.v[layer][slots] = value


class NaNOutsideWindows(PoolEdit):
    """NaN at every slot outside the window of every sequence of the batch (a slot of a shared
    prefix inside another sequence's window is kept), restored after the forward: the K/V
    this forward would not need if the runtime dropped it. Restored, because a later match may
    end earlier than this forward's start and need it again (see the module docstring)."""

    def forward(self, seqs: Sequence[PagedSeq], **kw) -> PagedOutput:
        kw = self.loaded(kw)
        outside = torch.cat([self.slots(s, range(0, max(0, s.start - WINDOW + 1))) for s in seqs])
        inside = torch.cat([self.slots(s, range(max(0, s.start - WINDOW + 1), len(s.slots))) for s in seqs])
        outside = outside[~torch.isin(outside, inside)]
        saved = self.inner.pool.buffer[:, :, outside].clone()
        self.fill(outside, float("nan"))
        try:
            return self.inner.forward(seqs, **kw)
        finally:
            self.inner.pool.buffer[:, :, outside] = saved


class DropWindowEdge(PoolEdit):
    """Zeroes each sequence's slot at the first position of its window (``start - W + 1``) for
    good: SWA KV dropped inside the window, an off-by-one drop rule."""

    def forward(self, seqs: Sequence[PagedSeq], **kw) -> PagedOutput:
        kw = self.loaded(kw)
        for s in seqs:
            if s.start - WINDOW + 1 > 0:
                self.fill(self.slots(s, range(s.start - WINDOW + 1, s.start - WINDOW + 2)), 0.0)
        return self.inner.forward(seqs, **kw)


async def serve(model, tmp_path, edit: type[PoolEdit] | None = None):
    """``serve_turns`` over the adapter (or the adapter with a planted ``edit``) and a file storage
    tier, ``TURNS`` turns. Returns (results as ``mismatches`` takes them, (turn, metrics) per
    turn, the ``edit`` wrapper or None)."""
    cfg = runtime_config(model, device_slots=DEVICE_SLOTS, storage_backend="file", storage_dir=str(tmp_path / "kv"))
    async with CacheRuntime.open(cfg) as rt:
        async def between_turns(t: int, srv: ServingLoop) -> None:
            await settle(rt)
            if t == 1:
                await evict_to_host(rt, srv, DEVICE_SLOTS)
            elif t == 2:
                assert await rt.flush() > 0
                assert (await rt.match_prefix(SYSTEM)) == {"device": 0, "host": 0}

        paged = PagedSWAModel(model, rt.device_pool)
        driven = paged if edit is None else edit(paged)
        results, metrics = await serve_turns(rt, model, between_turns, paged=driven, turns=TURNS)
        stats = await rt.stats()
    assert stats["copies"]["failures"] == 0 and stats["requests"]["live"] == 0
    return results, metrics, driven if edit is not None else None


async def test_every_tier_equals_generate_past_the_window(model, ref_model, tmp_path):
    results, metrics, _ = await serve(model, tmp_path)
    assert min(len(prompt) for _, prompt, _, _ in results) > WINDOW
    assert mismatches(ref_model, results) == []
    tier = {t: [m for turn, m in metrics if turn == t] for t in range(TURNS)}
    for m in (m for _, m in metrics):
        assert m.device_tokens + m.host_tokens + m.storage_tokens + m.recomputed_tokens == m.prompt_tokens
    served = {"device": sum(m.device_tokens for m in tier[1]), "host": sum(m.host_tokens for m in tier[2]),
              "storage": sum(m.storage_tokens for m in tier[3])}
    assert all(n > 0 for n in served.values()), served
    assert all(m.host_tokens > WINDOW for m in tier[2]) and all(m.storage_tokens > WINDOW for m in tier[3])


async def test_swa_kv_outside_the_window_dropped_still_equals_generate(model, ref_model, tmp_path):
    results, metrics, edit = await serve(model, tmp_path, NaNOutsideWindows)
    assert edit.edited > 0
    assert mismatches(ref_model, results) == []
    assert sum(m.host_tokens for _, m in metrics) > 0 and sum(m.storage_tokens for _, m in metrics) > 0


async def test_swa_kv_dropped_inside_the_window_is_caught(model, ref_model, tmp_path):
    results, _, edit = await serve(model, tmp_path, DropWindowEdge)
    assert edit.edited > 0
    bad = {line.split()[0] for line in mismatches(ref_model, results)}
    assert bad == {rid for rid, _, _, _ in results}, sorted(bad)


async def serve_sliding_pool(model, *, debug_invariants: bool = True, write_policy: str | None = None):
    """``serve_turns`` over a runtime whose sliding layers have a pool of their own of
    ``SWA_TOKENS`` slots: device-only (turns 1.. hit their history on device), or with a host tier
    under `write_policy`, where after turn 1 fillers push the conversations off device (their
    host copies keep the sliding KV their device copies had), so turn 2 loads from host.
    Returns (results, metrics, stats), stats with ``host_missing``: host pages without sliding KV
    (their device copies had dropped it) after the fillers."""
    host = dict(host_tokens=0) if write_policy is None else dict(write_policy=write_policy)
    cfg = runtime_config(model, device_slots=DEVICE_SLOTS, swa_tokens=SWA_TOKENS, debug_invariants=debug_invariants,
                         **host, **swa_config(model))
    async with CacheRuntime.open(cfg) as rt:
        assert len(rt.device_pool.k) == 1 and len(rt.swa_pool.k) == 3  # the full layer; the sliding ones
        paged = PagedSWAModel(model, rt.device_pool, swa_pool=rt.swa_pool, swa_map=rt.swa_map)

        async def between_turns(t: int, srv: ServingLoop) -> None:
            await settle(rt)
            if t == 1 and write_policy is not None:  # a request holds sliding pages for all its own
                for i in range(3):  # pages: fillers shorter than the sliding pool, one after another
                    await srv.generate(ids(SWA_TOKENS - 2 * PAGE, 90 + i), max_new_tokens=1, rid=f"filler{i}")
                    await settle(rt)
                missing.append(await rt.inspect(lambda core: sum(core.residency.group(SlidingWindow).host_missing.values())))

        missing: list[int] = []
        results, metrics = await serve_turns(rt, model, between_turns, paged=paged, turns=TURNS)
        stats = await rt.stats()
    stats["host_missing"] = sum(missing)
    return results, metrics, stats


@pytest.mark.parametrize("write_policy", [None, "write_through", "write_back"])
async def test_sliding_pool_drops_outside_windows_and_equals_generate(model, ref_model, write_policy):
    results, metrics, stats = await serve_sliding_pool(model, write_policy=write_policy)
    assert mismatches(ref_model, results) == []
    assert stats["swa"]["pages_dropped"] > 0, stats["swa"]
    assert sum(m.device_tokens for t, m in metrics if t > 0) > 0
    if write_policy is not None:
        assert sum(m.host_tokens for t, m in metrics if t == 2) > 0, [m.host_tokens for _, m in metrics]
    if write_policy == "write_back":  # backed up after drops: host copies without some sliding KV
        assert stats["host_missing"] > 0
    for _, m in metrics:
        assert m.device_tokens + m.host_tokens + m.recomputed_tokens == m.prompt_tokens


async def test_swa_drop_inside_the_window_is_caught(model, ref_model, monkeypatch):
    """The drop rule keeping one page less than the W - 1 tokens before each node end: a running
    request's window (or a hit's, just admitted) then reads a dropped slot, and the run fails."""
    monkeypatch.setattr(SlidingWindow, "limit",
                        lambda self, n: max(0, (n - self.window + 1 + self.page_size) // self.page_size))
    try:
        results, _, stats = await serve_sliding_pool(model, debug_invariants=False)
    except (LookupError, ServingError) as exc:
        # the model's LookupError, or a request's ServingError caused by it: which one leaves the
        # serving loop first depends on whether the loop's task ended before its close
        cause = exc if isinstance(exc, LookupError) else exc.__cause__
        assert isinstance(cause, LookupError) and "sliding KV was dropped" in str(cause)
    else:
        assert mismatches(ref_model, results) != [], stats["swa"]


LONG_SWA_TOKENS = 64  # 4 pages: a conversation of 40 + 60 tokens holds 7 pages of its own


async def test_a_conversation_longer_than_the_sliding_pool_equals_generate(model, ref_model):
    """A request gives back the sliding pages of its own pages before its window as it decodes:
    one conversation of 100 tokens through a sliding pool of 64 runs to the end with
    no preemption (before, the serving loop preempted it twice: no sliding page for its next page
    until a `finish` put its pages in the tree, whose drop rule could give them back), its greedy
    tokens equal to ``generate`` and its logits within 1e-4."""
    prompt, new = ids(40, 7), 60
    cfg = runtime_config(model, device_slots=DEVICE_SLOTS, swa_tokens=LONG_SWA_TOKENS, host_tokens=0,
                         **swa_config(model))
    async with CacheRuntime.open(cfg) as rt:
        paged = PagedSWAModel(model, rt.device_pool, swa_pool=rt.swa_pool, swa_map=rt.swa_map)
        # (admission probes room for prompt + reserve tokens at once: a reserve within the pool)
        async with ServingLoop(rt, paged, record_logits=True, max_reserve=PAGE) as srv:
            c = await srv.generate(prompt, max_new_tokens=new, rid="long")
            loop_stats = dict(srv.stats)
        stats = await rt.stats()
    assert len(prompt) + len(c.tokens) > LONG_SWA_TOKENS
    assert stats["swa"]["pages_dropped"] > 0 and loop_stats["preemptions"] == 0, (stats["swa"], loop_stats)
    assert mismatches(ref_model, [("long", prompt, c.tokens, c.logits)], new=new, tol=1e-4) == []
