"""The core's parts built on their own, with no event loop and no CacheCore.

Each test builds a `Residency` and the part above it by hand, drives it through its methods and
checks what it owns against the ledgers: the rules each part keeps without the others.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from runtime.config import RuntimeConfig
from runtime.errors import InternalError
from runtime.memory.owners import Owner
from runtime.storage.hashing import KVIdentity
from runtime.messages import Direction, OffloadAck, OffloadFinish
from runtime.tree.tiers.copies import CopyTracker
from runtime.tree.tiers.decode_offload import DecodeOffload
from runtime.tree.readiness import ManualReadiness
from runtime.tree.request_table import RequestTable
from runtime.tree.records import RequestRecord
from runtime.tree.residency import Residency
from runtime.tree.tiers.storage import StorageTier
from tests.tokens import toks

PS = 4


def config(**changes) -> RuntimeConfig:
    base = dict(num_layers=2, num_kv_heads=1, head_dim=2, page_size=PS, device_slots=64, host_tokens=128,
                write_policy="write_through")
    base.update(changes)
    return RuntimeConfig(**base)


def cached(res: Residency, prompt: np.ndarray, rid: str = "r"):
    """Insert `prompt` with fresh device pages of a request, as a finished request leaves them."""
    owner = Owner.request(rid, 1)
    slots = res.alloc_device(len(prompt) // PS, owner)
    out = res.insert(prompt, None, slots, owner, trusted=True)
    assert [len(s) for _, s in out.adopted] == [len(prompt)]
    return out.last_node


def test_residency_insert_hands_pages_to_the_node_and_delete_frees_them():
    res = Residency.from_config(config())
    node = cached(res, toks(16, 0))
    assert res.device.owned_slots(Owner.node(node.id)).tolist() == sorted(node.device.tolist())
    assert res.device.num_free_pages() == 16 - 4
    res.delete(node)
    assert res.device.num_free_pages() == 16 and res.tree.num_nodes == 0


def test_residency_write_back_eviction_returns_the_nodes_instead_of_copying():
    res = Residency.from_config(config(write_policy="write_back"))
    node = cached(res, toks(16, 0))
    free = res.device.num_free_pages()
    assert res.evict_device(4) == [node]  # needs a backup first: nothing freed, nothing issued
    assert res.device.num_free_pages() == free and node.device is not None
    assert not res.room_for(free + 4)  # and room_for agrees: those pages are not free now


def test_residency_eviction_without_host_deletes_and_room_for_agrees():
    res = Residency.from_config(config(host_tokens=0))
    cached(res, toks(16, 0))
    free = res.device.num_free_pages()
    assert res.room_for(free + 4)
    assert res.evict_device(4) == []
    assert res.device.num_free_pages() == free + 4


def test_copy_tracker_backup_pins_then_its_ack_hands_host_pages_to_the_node():
    res = Residency.from_config(config())
    copies = CopyTracker(res, itertools.count(1), 2, ManualReadiness)
    node = cached(res, toks(16, 0))
    assert copies.backup(node)
    assert not copies.backup(node)  # one backup per node at a time
    (plan, readiness), = copies.take_plans()
    assert readiness is None and copies.take_plans() == []
    assert plan.transfers[0].src.tolist() == node.device.tolist()
    assert res.device.pin_count(int(node.device[0])) == 1 and node.lock_ref == 1
    (out,) = copies.apply_ack(plan.op_id, None)
    assert out.backed_up and out.failed is None
    assert node.host is not None and node.lock_ref == 0 and not copies.ops and not copies.backup_pending
    assert res.host.owned_slots(Owner.node(node.id)).tolist() == sorted(node.host.tolist())
    assert res.device.pin_count(int(node.device[0])) == 0


def test_copy_tracker_batches_a_turns_backups_into_one_plan_pinned_once_and_acked_once():
    res = Residency.from_config(config())
    copies = CopyTracker(res, itertools.count(1), 2, ManualReadiness)
    a, b = cached(res, toks(16, 0)), cached(res, toks(8, 1))
    assert copies.backup(a) and copies.backup(b)
    # recorded at once (in flight, locked, host pages taken), pinned only when the batch leaves
    assert copies.busy(a) and copies.busy(b) and a.lock_ref == b.lock_ref == 1
    assert copies.unissued() == set(copies.ops) and res.device.pin_count(int(a.device[0])) == 0
    (plan, _), = copies.take_plans()
    assert not copies.unissued() and plan.op_id == min(copies.ops)
    assert plan.transfers[0].src.tolist() == a.device.tolist() + b.device.tolist()
    assert res.device.pin_count(int(b.device[0])) == 1
    with pytest.raises(InternalError):  # the second backup travels in the first one's batch
        copies.apply_ack(max(copies.ops), None)
    outs = copies.apply_ack(plan.op_id, None)
    assert [o.op.node for o in outs] == [a, b] and all(o.backed_up for o in outs)
    assert a.host is not None and b.host is not None and not copies.ops and not copies.backup_pending
    assert res.device.pin_count(int(a.device[0])) == res.host.pin_count(int(b.host[0])) == 0


def test_copy_tracker_failed_batch_frees_every_backups_host_pages():
    res = Residency.from_config(config())
    copies = CopyTracker(res, itertools.count(1), 2, ManualReadiness)
    a, b = cached(res, toks(16, 0)), cached(res, toks(8, 1))
    free = res.host.num_free_pages()
    copies.backup(a), copies.backup(b)
    (plan, _), = copies.take_plans()
    outs = copies.apply_ack(plan.op_id, "boom")
    assert not any(o.backed_up for o in outs) and copies.stats["copy_failures"] == 2
    assert a.host is None and b.host is None and res.host.num_free_pages() == free
    assert a.lock_ref == b.lock_ref == 0 and not copies.backup_pending


def test_copy_tracker_failed_load_names_its_users_and_rolls_back():
    res = Residency.from_config(config())
    copies = CopyTracker(res, itertools.count(1), 2, ManualReadiness)
    node = cached(res, toks(16, 0))
    copies.backup(node)
    (plan, _), = copies.take_plans()
    copies.apply_ack(plan.op_id, None)
    res.drop_device(node)  # host-only now
    owner = Owner.request("u", 1)
    device = res.alloc_device(4, owner)
    op = copies.start_load([node], 16, device, owner)
    copies.add_user(op.readiness, ("u", 1))
    assert copies.loads_under([node]) == [op.readiness] and copies.busy(node)
    assert copies.insert_cap(toks(16, 0), 16, None) == 0  # nothing may hang below a running load
    (out,) = copies.apply_ack(op.op_id, "boom")
    assert out.failed == "boom" and out.failed_users == {("u", 1)}
    assert node.device is None and res.device.num_free_pages() == 16 and not copies.loading


def test_decode_offload_keeps_device_slots_until_release_after_the_last_ack():
    res = Residency.from_config(config(decode_offload=True))
    offload = DecodeOffload(res, itertools.count(1))
    owner = Owner.request("a", 1)
    prompt = toks(8, 0)
    slots = res.alloc_device(2, owner)
    rec = RequestRecord("a", 1, owner, None, prompt, 0, None, 8)
    table = RequestTable(res.page_size)
    table.add(rec, slots, 8, 8)
    table.detach(rec)  # a retired record keeps a private copy of its row
    started = offload.start("a", 1, 0, 8, rec)
    assert started is not None and offload.owns(started.op_id)
    offload.retire(rec, 8)
    assert isinstance(offload.take_notes()[-1], OffloadFinish)
    with pytest.raises(RuntimeError, match="in flight"):
        offload.release("a", 1, set())  # a copy still reads its slots (seed 000)
    assert res.device.owned_slots(owner).tolist() == sorted(slots.tolist())
    offload.apply_ack(started.op_id, None)
    assert offload.take_notes() == [OffloadAck("a", 1, started.op_id, True)]
    taken = offload.release("a", 1, set())
    assert taken is not None and taken[1] == 8  # the landed pages became a host-only node
    assert offload.release("a", 1, set()) is False  # once
    assert res.device.num_free_pages() == 16 and len(res.device.owned_slots(owner)) == 0
    assert res.tree.num_nodes == 1 and taken[0].host is not None and taken[0].device is None
    (plan,) = offload.take_plans()
    assert plan.direction is Direction.BACKUP


def test_storage_tier_lookup_that_finds_nothing_ends_the_prefetch():
    cfg = config()
    res = Residency.from_config(cfg)
    storage = StorageTier(cfg, res, itertools.count(1), KVIdentity.from_config(cfg))
    assert storage.prepare("p", toks(33, 0), None) == 32
    (op_id, write, keys, pages, rank_keys, _states), = storage.take_requests()
    assert not write and len(keys) == 8 and pages == () and rank_keys == ()  # one rank: one key list
    assert "p" in storage.prefetches
    pf = storage.apply_ack(op_id, 0, None, (), set())
    assert pf is not None and pf.rid == "p" and not storage.prefetches and not storage.ops
    assert storage.forget("p")  # a prepared rid: its abort is not an unknown rid
    assert res.host.num_free_pages() == res.host.num_pages
