"""The admit path's length, traced (`benchmarks/trace_admit.py`): a structural test, no timing.

The traced admit of a host hit and of a storage hit (`wait_complete`, no `prepare`) may run at
most so many file-to-file transitions, send exactly these messages and take these actor turns.
The ceilings are this tree's figures (a ratchet: they may only come down); the goal is a host
hit in <= 70 transitions and <= 3 messages, a storage hit in <= 120 and <= 6.

Checked against the code before the mailbox and admit-entry changes (this file and the tracer
copied into a checkout of it): both tests failed there. The host hit took 123 transitions
(> 100) with the same messages; the storage hit took 242 transitions, and its messages had no
`StorageDone` (its completions were applied from a loop callback, not the mailbox).
"""

from __future__ import annotations

import asyncio

from benchmarks.trace_admit import trace_host_hit, trace_storage_hit

HOST_TRANSITIONS = 100
# 200 before the backend gate (runtime/actors/backend_gate.py): each storage op asks it whether
# its call may start and tells it the outcome, one hop each way (a healthy backend: no more)
STORAGE_TRANSITIONS = 209


def test_a_host_hit_admit_is_one_message_each_way_per_hop():
    trace = asyncio.run(trace_host_hit())
    assert trace.cached == 40
    # the admit, the load to the transfer actor, its completion, its ack
    assert trace.messages == ["Admit", "SubmitCopy", "CopyDone", "TransferAck"]
    assert (trace.turns["tree"], trace.turns["transfer"]) == (2, 2)
    assert trace.transitions <= HOST_TRANSITIONS, trace.summary()


def test_a_storage_hit_admit_comes_back_through_the_mailboxes():
    trace = asyncio.run(trace_storage_hit())
    assert trace.cached == 40
    # lookup, then the read of what it found, then the load; every completion through the
    # transfer actor's mailbox, every ack to the tree actor's
    assert trace.messages == ["Admit", "SubmitStorage", "StorageDone", "StorageAck", "SubmitStorage", "StorageDone",
                              "StorageAck", "SubmitCopy", "CopyDone", "TransferAck"]
    assert (trace.turns["tree"], trace.turns["transfer"]) == (4, 6)
    assert trace.transitions <= STORAGE_TRANSITIONS, trace.summary()
