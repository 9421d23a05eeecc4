"""What the API fuzzer found, as shrunk reproductions that must replay clean.

Each case is a fuzzer episode shrunk by `harness.shrink` (tokens of continuations shortened by
hand where they do not matter), replayed with every oracle of the harness on a fresh runtime:
it passes once the runtime keeps the promise the violation names. All run on the fake copy
engine without storage unless said, so each replays the same way every time.
"""

from __future__ import annotations

import pytest

from tests.fuzz.harness import FuzzConfig, Step, replay_steps


def _admit(rid: str, tokens: list[int], cont_len: int = 24, ns: object = None, session: str | None = None) -> Step:
    return "admit", {"rid": rid, "tokens": tokens, "cont": [7] * cont_len, "ns": ns, "session": session, "cancel": None}


def _finish(rid: str, m: int, finished_len: int | None = None) -> Step:
    return "finish", {"rid": rid, "m": m, "finished_len": finished_len, "flip": None}


SESSION_PLAN = [1, 308, 192, 374, 98, 80, 81, 439, 276, 275, 291, 473, 444, 473, 399, 58, 463, 183, 311, 41, 230,
                457, 466, 128, 139, 417, 20, 73, 123, 67]
PROMPT_A = [437, 199, 107, 319, 137, 491, 52, 237, 252, 276, 331, 306, 176, 461]
PROMPT_B = [2, 406, 374, 362, 331, 324, 27, 242, 186, 395, 311, 70, 303, 54, 35, 347, 4]
SWA_PROMPT = [37, 314, 422, 200, 65, 263, 106, 294, 283, 465, 255, 396, 113, 256, 188, 155, 412, 91, 240, 129, 216,
              304, 499]

FINDINGS: dict[str, tuple[FuzzConfig, list[Step]]] = {
    # A turn's finish that keeps fewer tokens than its session already had (here 1 of 3): the
    # session keeps its 3 slots for 1 token and the actor's invariant check fails the runtime.
    # Refusing it (LengthError) or trimming the session would both do.
    "session_turn_keeps_fewer_tokens_than_its_session": (
        FuzzConfig(page_size=1, device_pages=30, host_pages=0),
        [("open_session", {"sid": "s2", "plan": SESSION_PLAN, "ns": None}),
         ("admit", {"rid": "r29", "tokens": SESSION_PLAN[:2], "cont": SESSION_PLAN[2:], "ns": None, "session": "s2",
                    "cancel": None}),
         ("extend", {"rid": "r29", "n": 1}),
         _finish("r29", 3),
         ("admit", {"rid": "r24", "tokens": SESSION_PLAN[:5], "cont": SESSION_PLAN[5:], "ns": None, "session": "s2",
                    "cancel": None}),
         _finish("r24", 1)]),
    # can_admit says no where admit's eviction frees enough at once: the dry run
    # (`Residency.freeable_now`) keeps a parent whose only device child it has just evicted, because the
    # real tree still lists that child (`node.children`); the eviction that can_admit's "no"
    # then starts deletes both (write_through_selective: no host copies), and the admit right
    # after succeeds.
    "can_admit_no_then_admit_succeeds": (
        FuzzConfig(page_size=4, device_pages=9, host_pages=15, write_policy="write_through_selective"),
        [_admit("r11", [437, 199, 107, 319, 137, 6, 165, 186, 6, 272, 183]),
         _admit("r12", [113]),
         _admit("r14", PROMPT_A),
         _finish("r14", 7),
         ("batch", {"items": [("admit", {"rid": "r15", "tokens": [61, 195, 371, 145, 253, 65, 419, 468, 389],
                                         "cont": [7] * 27, "ns": None})], "cancel": None}),
         _finish("r11", 11, 0),
         ("extend", {"rid": "r15", "n": 4}),
         ("can_then_admit", {"rid": "r18", "tokens": PROMPT_A, "cont": [7] * 22, "ns": "tenant-a"})]),
    # can_admit says no where admit's eviction frees enough at once, second way (seed 3, episode
    # 47): the prompt matches only the first page of a cached node; the dry run kept the whole node
    # as the request's own prefix, where the admission splits it and may evict the unmatched part.
    # The "no" then evicted the node (prefix and all) and the admit right after succeeded.
    "can_admit_no_for_a_prefix_that_ends_inside_a_node": (
        FuzzConfig(page_size=4, device_pages=6, host_pages=12, write_policy="write_through_selective"),
        [_admit("r1", PROMPT_A + PROMPT_B[:7]),
         _finish("r1", 21),
         ("can_then_admit", {"rid": "r2", "tokens": PROMPT_A[:5] + PROMPT_B[:11], "cont": [7] * 20, "ns": None})]),
    # A load that fails after its request cached past the loading nodes (an impatient caller:
    # it computed before the load's readiness) fails the runtime in the rollback:
    # TreeError('detach_device of node 2: not an evictable device leaf (... device children=1)').
    "load_fails_after_its_request_cached_past_it": (
        FuzzConfig(page_size=1, device_pages=34, host_pages=64, write_policy="write_back", eviction_policy="priority",
                   copy_faults=True, impatient=True),
        [_admit("r3", PROMPT_B),
         ("batch", {"items": [("admit", {"rid": "r4", "tokens": [208, 326, 240, 255], "cont": [7] * 30,
                                         "ns": "tenant-a"})], "cancel": None}),
         ("extend", {"rid": "r3", "n": 2}),
         _finish("r3", 19),
         _admit("r5", [461, 381, 168, 216, 449, 421, 399, 218, 485, 411, 25, 177, 453, 120, 478], ns="tenant-a"),
         ("release", {"which": 33293, "layers": None, "fail": False}),
         _admit("r16", PROMPT_B),
         ("cache", {"rid": "r16", "m": 17, "flip": None}),
         ("release", {"which": 30753, "layers": None, "fail": True})]),
    # After a failed load, a node that live requests still lock has no device copy and is taken
    # as an evictable host leaf; evicting it for an offload's host pages fails the runtime:
    # RuntimeError('offload start refused: delete_leaf of node 4: locked'). The same
    # `delete_leaf ... locked` failure came from flush() and from admits (CPU engine, storage).
    "locked_node_without_device_copy_evicted_from_host": (
        FuzzConfig(page_size=1, device_pages=31, host_pages=30, write_policy="write_through_selective",
                   eviction_policy="priority", host_layout="page_first", decode_offload=True, offload_stride_pages=2,
                   copy_faults=True),
        [
            ('admit', {'rid': 'r31', 'tokens': [29, 305, 337, 130, 332, 323], 'cont': [118, 432, 254, 259, 423, 244, 283, 462, 132, 235, 249, 218, 164, 216, 35, 280, 216, 462, 289, 192, 74, 20, 133, 424, 206], 'ns': ('lora', 7), 'session': None, 'cancel': None}),
            ('admit', {'rid': 'r36', 'tokens': [214, 209, 47, 5, 143, 42, 319], 'cont': [44, 56, 16, 492, 397, 139, 463, 273, 192, 287, 435, 139, 319, 145, 355, 95, 465, 256, 165, 250, 370, 4, 238, 465], 'ns': None, 'session': None, 'cancel': None}),
            ('cache', {'rid': 'r31', 'm': 6, 'flip': None}),
            ('finish', {'rid': 'r36', 'm': 7, 'finished_len': None, 'flip': None}),
            ('extend', {'rid': 'r34', 'n': 2}),
            ('release', {'which': 46871, 'layers': None, 'fail': False}),
            ('batch', {'items': [('admit', {'rid': 'r37', 'tokens': [214, 209, 47, 5, 143, 245, 302, 251, 174, 416, 175, 461, 449], 'cont': [31, 425, 307, 366, 301, 496, 178, 211, 227, 178, 113, 56, 41, 379, 441, 56, 180, 483], 'ns': None}), ('extend', {'rid': 'r31', 'n': 2})], 'cancel': None}),
            ('release', {'which': 63242, 'layers': None, 'fail': True}),
            ('extend', {'rid': 'r31', 'n': 2}),
            ('finish', {'rid': 'r31', 'm': 10, 'finished_len': 4, 'flip': None}),
            ('open_session', {'sid': 's1', 'plan': [439, 117, 324, 14, 407, 39, 459, 181, 251, 449, 153, 55, 463, 115, 311, 39, 397, 175, 328, 93, 368, 156, 418, 401, 32, 1, 125, 42, 269, 361, 146], 'ns': None}),
            ('release', {'which': 40005, 'layers': None, 'fail': False}),
            ('admit', {'rid': 'r39', 'tokens': [439, 117, 324, 14], 'cont': [407, 39, 459, 181, 251, 449, 153, 55, 463, 115, 311, 39, 397, 175, 328, 93, 368, 156, 418, 401, 32, 1, 125, 42, 269, 361, 146], 'ns': None, 'session': 's1', 'cancel': None}),
            ('batch', {'items': [('commit', {'rid': 'r37', 'c': 12})], 'cancel': None}),
            ('admit', {'rid': 'r40', 'tokens': [214, 209, 47, 5, 143, 245, 302, 251, 174, 416, 175, 461, 449, 31], 'cont': [425, 307, 366, 301, 496, 178, 211, 227, 178, 113, 56, 41, 379, 441, 56, 180, 483], 'ns': None, 'session': None, 'cancel': None}),
            ('admit', {'rid': 'r38', 'tokens': [483, 271, 381, 391, 173, 88, 263, 174, 219], 'cont': [12, 368, 497, 119, 142, 428, 426, 29, 176, 348, 342, 294, 192, 485, 363, 338, 3, 59, 107, 378, 65, 485], 'ns': None, 'session': None, 'cancel': None}),
            ('extend', {'rid': 'r38', 'n': 2}),
            ('extend', {'rid': 'r38', 'n': 2}),
            ('commit', {'rid': 'r38', 'c': 13}),
        ]),
    # With storage on, an admit (wait_complete) starts its own storage lookup; the lookup's miss
    # marks the rid as "prepared", so an abort after the request finished succeeds instead of
    # raising UnknownRequestError (a double release the caller is not told about).
    "abort_after_finish_succeeds_with_storage": (
        FuzzConfig(page_size=4, device_pages=6, host_pages=7, storage="file"),
        [_admit("r42", [117, 250, 180, 78, 73], 19),
         _finish("r42", 5, 0),
         ("abort", {"rid": "r42"})]),
    # Recurrent state (seed 1, episode 39, shrunk by hand): three live requests hold all three state
    # slots (each its running slot), so no state slot is free or evictable; can_admit answered yes
    # (it asked only for device pages) and the admit right after raised CapacityError. Fixed: both
    # ask `RecurrentStates.room_for` (docs/API.md, "Capacity": they decide by one answer).
    "can_admit_ignores_state_slots": (
        FuzzConfig(page_size=4, device_pages=8, host_pages=0, state_slots=3),
        [_admit("r1", [143, 445, 302, 34, 450], 4),
         _admit("r2", [116, 479, 167, 359, 427], 4),
         _admit("r3", [45, 308, 435, 129, 30], 4),
         ("can_then_admit", {"rid": "r4", "tokens": [5, 6, 7], "cont": [7] * 4, "ns": None})]),
    # Sliding window (seed 1, episode 178): a crowd's first load fails; its request r67 stays live
    # with its hit rolled back (the loaded pages freed, their sliding pages with them), and the
    # invariant checker, holding r67's window to have sliding KV, failed the runtime at the ack:
    # "request 'r67' (cached 2) reads positions 0..0 in its sliding window, whose sliding KV was
    # dropped". Fixed in the checker: a request whose load failed reads nothing until released.
    "failed_load_request_held_to_its_sliding_window": (
        FuzzConfig(page_size=1, device_pages=23, host_pages=27, write_policy="write_back", eviction_policy="lfu",
                   copy_faults=True, sliding_layers="0,2", sliding_window=4, swa_pages=16),
        [("batch", {"items": [("admit", {"rid": "r1", "tokens": [37, 314, 422, 105], "cont": [7] * 19,
                                         "ns": ("lora", 7)})], "cancel": None}),
         _finish("r1", 4, 0),
         ("batch", {"items": [("admit", {"rid": "r4", "tokens": SWA_PROMPT[:9], "cont": SWA_PROMPT[9:],
                                         "ns": ("lora", 7)})], "cancel": None}),
         _admit("r6", [302, 472, 206, 271, 325], 18),
         _finish("r4", 8),
         _admit("r1", [311, 236, 177, 478, 333], 18, "tenant-a"),
         ("settle", {}),
         ("crowd", {"pressure": {"rid": "r66", "tokens": [205, 499, 231, 406, 239, 451, 376, 241, 162, 45, 449, 105,
                                                          417, 376, 38, 240, 108, 419, 349, 455, 420, 60],
                                 "cont": [417]},
                    "items": [("admit", {"rid": rid, "tokens": SWA_PROMPT[:n], "cont": SWA_PROMPT[n:],
                                         "ns": ("lora", 7)}) for rid, n in (("r67", 3), ("r68", 9), ("r69", 13))],
                    "fail_first_load": True})]),
}


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_finding_replays_clean(name):
    cfg, steps = FINDINGS[name]
    violation = replay_steps(cfg, steps)
    assert violation is None, f"{name}: {violation}"
