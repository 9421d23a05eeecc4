"""The connector's KV events under vLLM 0.33's real scheduler on CPU (`runtime.integrations.vllm.events`).

vLLM's scheduler publishes, each step, one `KVEventBatch` of its own GPU events and the
connector's (`take_events`). The tests put a collector in the scheduler's `kv_event_publisher`
that encodes each batch with msgspec as vLLM's ZMQ publisher does and decodes the bytes with the
runtime's wire classes: what a subscriber of vLLM's socket would read. The expected names are
computed independently: vLLM's block hasher over every request's tokens, beside the storage tier's
page hashes of the same tokens.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by scripts/install_vllm.sh")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from runtime.events import CPU, GPU, STORAGE, BlockRemoved, BlockStored, PrefixIndex, decode  # noqa: E402
from runtime.integrations.vllm.events import ConnectorEvents  # noqa: E402
from runtime.storage.hashing import page_hashes  # noqa: E402
from tests.e2e.test_vllm_connector import SYSTEM, model_dir  # noqa: E402,F401 (the fixture)
from tests.e2e.vllm_engine import BLOCK, FakeEngine, vllm_config  # noqa: E402


class Collector:
    """vLLM's `EventPublisher` interface: each batch through msgspec's bytes, as a subscriber gets it."""

    def __init__(self) -> None:
        self.batches = []
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, batch) -> None:  # noqa: ANN001
        self.batches.append(decode(self._encoder.encode(batch)))

    def shutdown(self) -> None:
        pass


def events_engine(model_dir: str, tmp_path, host_blocks: int = 20) -> tuple[FakeEngine, Collector]:
    config = vllm_config(model_dir, connector="HiCacheConnector", kv_events=True,
                         extra={"host_blocks": host_blocks, "storage_dir": str(tmp_path / "kv")})
    e = FakeEngine(config, 12)
    collector = e.scheduler.kv_event_publisher = Collector()
    return e, collector


def salted_conversation(e: FakeEngine, sessions: int, turns: int) -> list[tuple[list[int], str | None]]:
    """Multi-turn sessions as `test_vllm_connector.conversation`, odd sessions under a cache salt;
    returns every request's whole token sequence with its salt."""
    salt = {s: (f"tenant{s}" if s % 2 else None) for s in range(sessions)}
    history = {s: list(SYSTEM) for s in range(sessions)}
    seqs = []
    for turn in range(turns):
        for s in range(sessions):
            history[s] += [200 + 37 * s + turn] * 20
            e.add(f"s{s}t{turn}", history[s] + [7], 4, cache_salt=salt[s])
        e.run()
        for s in range(sessions):
            history[s] += [7] + e.outputs[f"s{s}t{turn}"]
            seqs.append((list(history[s]), salt[s]))
    return seqs


def reference_names(e: FakeEngine, seqs: list[tuple[list[int], str | None]]) -> dict[bytes, int | bytes]:
    """Our page hash -> vLLM's block hash of every whole page of `seqs`, each computed on its own:
    the storage tier's hash function and vLLM's block hasher (a fresh `Request`) over the tokens."""
    conn = e.connector
    out = {}
    for tokens, salt in seqs:
        req = Request(request_id="ref", prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256), cache_salt=salt)
        ours = page_hashes(np.asarray(tokens), BLOCK, None if salt is None else ("vllm", None, salt), conn.identity)
        assert len(ours) == len(req.block_hashes)
        out.update(zip(ours, map(maybe_convert_block_hash, req.block_hashes)))  # (as vLLM's events carry them)
    return out


def check_events(e: FakeEngine, collector: Collector, ref: dict[bytes, int | bytes], evicted: bool = True) -> None:
    """The published events against the tiers (`evicted`: the host tier evicted; else it did not)."""
    conn = e.connector
    core = conn.core
    stored = [ev for b in collector.batches for ev in b.events if type(ev) is BlockStored]
    removed = [ev for b in collector.batches for ev in b.events if type(ev) is BlockRemoved]
    assert any(ev.medium == CPU for ev in stored) and any(ev.medium == STORAGE for ev in stored)
    assert any(ev.medium == CPU for ev in removed) == evicted == (core.residency.stats["host_evicted_tokens"] > 0)
    assert core.stats["tokens_loaded"] > 0
    # an index rebuilt from the events alone equals the tiers, by vLLM's block hash
    index = PrefixIndex(shared_storage=False)
    for batch in collector.batches:
        index.apply("vllm-0", batch)
    tree = core.residency.tree
    host = set()
    for node in tree.nodes():
        if node.host is not None:
            ours = page_hashes(tree.path_tokens(node), BLOCK, node.extra_key, conn.identity)
            host.update(ref[h] for h in ours[-(node.num_tokens // BLOCK):])
    assert host and index.pages("vllm-0", CPU) == host, "the index's CPU pages are not the host tier's"
    assert index.pages("vllm-0", STORAGE) == {ref[h] for h in core.storage.known}, \
        "the index's STORAGE pages are not those known stored"
    # the same block named alike by vLLM's GPU events and the connector's (tokens, parent, extra keys)
    gpu = {}
    for ev in stored:
        if ev.medium == GPU:
            for i, h in enumerate(ev.block_hashes):
                gpu[h] = (ev.token_ids[i * BLOCK:(i + 1) * BLOCK], ev.extra_keys[i] if ev.extra_keys else None,
                          ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1])
    shared = 0
    for ev in stored:
        if ev.medium != GPU:
            assert ev.block_size == BLOCK
            for i, h in enumerate(ev.block_hashes):
                mine = (ev.token_ids[i * BLOCK:(i + 1) * BLOCK], ev.extra_keys[i] if ev.extra_keys else None,
                        ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1])
                if h in gpu:
                    assert mine == gpu[h], (ev.medium, h, mine, gpu[h])
                    shared += 1
    assert shared > 0
    assert conn.events.unnamed == 0
    # no name kept past its page (the engine drained: no op in flight)
    assert set(conn.events.names()) == {h for h, p in conn.events._pages.items()} and not conn.events._learned


def test_the_connector_publishes_cpu_and_storage_events_under_vllms_block_hashes(model_dir, tmp_path):
    """Six sessions (three under a cache salt) over a 12-block device pool and a 20-block host
    tier with storage behind it: vLLM's prefix cache evicts, the host tier serves and evicts,
    storage keeps what it wrote. The published batches hold CPU stores of the blocks backed up,
    CPU removals of the host tier's evictions, STORAGE stores of confirmed writes; an index rebuilt
    from them equals the host tier and storage's known pages by vLLM's block hash, and a block
    in both vLLM's GPU events and ours has the same tokens, parent and extra keys. Checked failing
    against a connector that names pages by our storage hashes (`ConnectorEvents.learn` skipped:
    every name unknown), and against the variant below (no removal on host eviction)."""
    e, collector = events_engine(model_dir, tmp_path)
    seqs = salted_conversation(e, sessions=6, turns=3)
    e.assert_drained()
    check_events(e, collector, reference_names(e, seqs))


def test_pages_a_fresh_instance_reads_from_storage_another_wrote_are_named_by_vllms_hashes(model_dir, tmp_path):
    """A second instance over the first's storage: the same conversation loads what the first
    wrote, so its CPU and STORAGE stores are of pages it learned only from its storage reads (its
    host tier is big enough never to evict). Checked failing with the reads' `learn` skipped
    (the pages are announced under our storage hashes), and it found that a tiers-only storage
    read announced the pages it found with no parent (`StorageTier.read` now takes the `link`)."""
    first, _ = events_engine(model_dir, tmp_path)
    salted_conversation(first, sessions=6, turns=3)
    first.connector.shutdown()
    second, collector = events_engine(model_dir, tmp_path, host_blocks=256)
    seqs = salted_conversation(second, sessions=6, turns=3)
    second.assert_drained()
    assert second.connector.core.stats["tokens_storage_loaded"] > 0
    check_events(second, collector, reference_names(second, seqs), evicted=False)


def test_a_connector_that_does_not_report_host_evictions_is_caught(model_dir, tmp_path, monkeypatch):
    """The broken variant: CPU removals dropped. The index keeps evicted pages on CPU."""
    event = ConnectorEvents._event

    def no_cpu_removals(self, r):  # noqa: ANN001, ANN202
        ev = event(self, r)
        return BlockRemoved(block_hashes=[], medium=ev.medium) if type(ev).__name__ == "BlockRemoved" and \
            ev.medium == CPU else ev

    monkeypatch.setattr(ConnectorEvents, "_event", no_cpu_removals)
    e, collector = events_engine(model_dir, tmp_path)
    seqs = salted_conversation(e, sessions=6, turns=3)
    with pytest.raises(AssertionError, match="CPU pages are not the host tier's"):
        check_events(e, collector, reference_names(e, seqs))


def test_events_are_off_unless_vllms_kv_events_are_on(model_dir, tmp_path):
    e = FakeEngine(vllm_config(model_dir, connector="HiCacheConnector", extra={"host_blocks": 20}), 12)
    assert e.connector.events is None and not e.connector.core.residency.records_events()
    salted_conversation(e, sessions=2, turns=1)
    assert list(e.connector.take_events()) == []
