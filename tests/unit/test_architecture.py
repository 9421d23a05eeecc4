"""The package's structure, checked over the source (AST, no import): who may write an attribute,
who may read a private one, and which way imports go (docs/ARCHITECTURE.md, "Import direction").

- Ownership: a module writes only attributes of `self` / `cls`, and reads attributes starting
  with `_` only of `self` / `cls`. A write is an assignment, augmented assignment or deletion of
  another object's attribute (`x.attr = v`), of an item of it (`x.attr[i] = v`, `del x.attr[k]`,
  `x.attr[i] += 1`), or a mutating method call on it (`x.attr.append(v)`, `.update`, `.pop`,
  numpy's in-place `.fill`...: `MUTATORS`); `x` is anything but `self` / `cls` (`self.part.attr`
  is another part's attribute). Dunders (`exc.__cause__`) are Python's
  protocol, not a part's state, and are left out. What does not follow the rule yet is listed in
  `WRITES` / `PRIVATE_READS` below, each entry with its reason; the lists may only shrink (a fixed
  entry must go: an entry no longer used fails, and so does a list longer than its ratchet).
- Import direction: a module imports only modules of its own layer or below (`LAYERS`); imports
  under `if TYPE_CHECKING:` are annotations, not dependencies, and are left out.

- Ledger owners: the token pools' ledgers change owners (alloc, free, assign, hold) only in
  `Residency`, which pairs every tree change with its ledger change (`ledger_calls`).

Each checker is shown failing on a planted violation (a module written to a temporary directory).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "runtime"

# -- import direction --------------------------------------------------------------------------
# lowest first; a module may import from its own layer and those before it (a package prefix
# covers its submodules; the longest prefix decides)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime.errors", "runtime.trace", "runtime.timeline", "runtime.phase"),  # foundation (the timeline: the trace file converted, imports nothing)
    ("runtime.memory",),  # pools and slot ledgers
    ("runtime.config", "runtime.config_sources", "runtime.messages", "runtime.completion",
     "runtime.validation", "runtime.stats", "runtime.fingerprint"),  # values the parts exchange
    ("runtime.storage",),  # storage backends, page hashing
    ("runtime.transfer",),  # copy engines
    ("runtime.tree", "runtime.events", "runtime.invariants"),  # the synchronous core, KV events
    ("runtime.actors", "runtime.supervisor"),  # actors over the core
    ("runtime.runtime", "runtime.assembly", "runtime.metrics", "runtime.audit"),  # the façade, its assembly, exporter, tools
    ("runtime.integrations",),  # engines and frameworks on the façade or the core
    ("runtime",),  # the package's public names (runtime/__init__.py)
)


def layer_of(module: str) -> int | None:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(imported module, line) of every import that runs (not under `if TYPE_CHECKING:`)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                yield ".".join(base + ([node.module] if node.module else [])), node.lineno
            else:
                yield node.module or "", node.lineno
        stack.extend(ast.iter_child_nodes(node))


def import_violations(root: Path) -> list[str]:
    out = []
    for path in sorted((root / "runtime").rglob("*.py")):
        module = module_name(path, root)
        own = layer_of(module)
        assert own is not None, f"{module} is in no layer: add it to LAYERS (and to docs/ARCHITECTURE.md)"
        tree = ast.parse(path.read_text(), str(path))
        for imported, line in imports(tree, module, path.name == "__init__.py"):
            if imported != "runtime" and not imported.startswith("runtime."):
                continue
            theirs = layer_of(imported)
            if theirs is not None and theirs > own:
                out.append(f"{path.relative_to(root)}:{line}: {module} (layer {own}) imports {imported} "
                           f"(layer {theirs}, above it)")
    return out


# -- ownership -----------------------------------------------------------------------------------
def _own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _dunder(attr: str) -> bool:
    return attr.startswith("__") and attr.endswith("__")


def _protocol(a: ast.Attribute) -> bool:
    """Not a part's state: a dunder (`exc.__cause__`, Python's protocol), numpy's read-only flag
    of an array (`arr.flags.writeable`) or the process environment (`os.environ[k] = v`)."""
    if _dunder(a.attr):
        return True
    if a.attr == "writeable" and isinstance(a.value, ast.Attribute) and a.value.attr == "flags":
        return True
    return a.attr == "environ" and isinstance(a.value, ast.Name) and a.value.id == "os"


# method calls that change the object they are called on (containers, deques, numpy arrays)
MUTATORS = frozenset({
    "append", "extend", "add", "update", "pop", "remove", "discard", "clear", "setdefault", "insert", "popitem",
    "__setitem__", "__delitem__", "difference_update", "intersection_update", "symmetric_difference_update",
    "appendleft", "popleft", "extendleft", "sort", "reverse", "fill", "itemset", "resize", "put",
})


def _changed_attribute(node: ast.expr) -> ast.Attribute | None:
    """The attribute a write target or a mutated object is (`x.a`), or an item of (`x.a[i][j]`)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Attribute) else None


def ownership_findings(path: Path, rel: str) -> Iterator[tuple[str, str, str, int]]:
    """("write" | "private-read", file, attribute, line) for every write of another object's
    attribute (assigned, augmented, deleted, an item of it written, or a mutating method called on
    it) and every read of another object's `_` attribute in the file at `path`."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and not isinstance(node.func.value, ast.Name)):
            targets = [node.func.value]  # x.attr.append(v): a write of x.attr (a local's own method: not one)
        while targets:
            t = targets.pop()
            if isinstance(t, ast.Tuple | ast.List):
                targets.extend(t.elts)
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif (a := _changed_attribute(t)) is not None and not _own(a.value) and not _protocol(a):
                yield "write", rel, a.attr, a.lineno
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr.startswith("_")
                and not _dunder(node.attr) and not _own(node.value)):
            yield "private-read", rel, node.attr, node.lineno


def ownership_violations(root: Path, writes: dict[tuple[str, str], str],
                         reads: dict[tuple[str, str], str]) -> tuple[list[str], set[tuple[str, str, str]]]:
    """(findings not allowed, allow-list entries used) over `root`/runtime."""
    bad, used = [], set()
    for path in sorted((root / "runtime").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for kind, file, attr, line in ownership_findings(path, rel):
            allowed = writes if kind == "write" else reads
            if (file, attr) in allowed:
                used.add((kind, file, attr))
            else:
                bad.append(f"{file}:{line}: {kind} of another object's attribute {attr!r}")
    return bad, used


# -- one place changes the token ledgers' owners -----------------------------------------------
# The token pools' ledgers (device, host) are changed (alloc, free, assign, hold) only by their
# owner, Residency, which pairs each tree change with its ledger change; a part asks it
# (`Residency.free_device`, ...). A group's own ledger (`self.ledger`) is that group's.
LEDGER_MUTATORS = frozenset({"alloc", "alloc_held", "free", "assign", "hold", "unhold"})
LEDGERS = frozenset({"device", "host", "ledger", "host_ledger"})
LEDGER_OWNERS = frozenset({"runtime/tree/residency.py"})
LEDGER_CALLS: dict[str, str] = {
    "runtime/integrations/vllm/core.py": "the vLLM-mode core over a host-only Residency (its own host ledger use)",
}


def ledger_calls(root: Path) -> list[str]:
    """Calls that change a token ledger's owners from outside its owner (`x.host.free(...)`,
    `self.residency.device.assign(...)`), by file and line, but in `LEDGER_OWNERS`/`LEDGER_CALLS`."""
    out = []
    for path in sorted((root / "runtime").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in LEDGER_OWNERS or rel in LEDGER_CALLS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEDGER_MUTATORS and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr in LEDGERS and not _own(node.func.value.value)):
                out.append(f"{rel}:{node.lineno}: {node.func.value.attr}.{node.func.attr} outside the ledger's owner")
    return out


# Writes of another part's attribute that are there today, by file and attribute, with the reason.
# The list may only shrink: remove an entry when you fix it (and lower `WRITES_RATCHET`).
_FRIEND = "a helper class of the same module (one part in two classes)"
_RECORD = "a plain record (dataclass) of this module's part: the part is its one writer"
_NODE = "Node is the radix tree's plain value type (runtime/tree/nodes.py): RadixTree is its one writer"
_LOOK = "a MatchResult the tree builds and fills in the same call"
_ENGINE_OP = "the engine's own in-flight op record"
_HF = "patches the Hugging Face model it wraps (its hooks and attention implementation)"
_SERVING = "the demo scheduler's own request and metrics records"
_SPLIT = ("the vLLM-mode core sets its residency's tree split hook, which Residency now gives the tree at its "
          "making: the one write into the tree from outside its owner left (integrations/vllm/core.py)")
WRITES: dict[tuple[str, str], str] = {
    ("runtime/actors/offload_actor.py", "finished"): "the offload actor's per-request progress record",
    ("runtime/actors/offload_actor.py", "inflight"): "the offload actor's per-request progress record",
    ("runtime/actors/offload_actor.py", "offloaded"): "the offload actor's per-request progress record",
    ("runtime/actors/transfer_actor.py", "done"): "the transfer actor's in-flight entry record",
    ("runtime/actors/transfer_actor.py", "error"): "the transfer actor's in-flight entry record",
    ("runtime/actors/transfer_actor.py", "started"): "the transfer actor's in-flight entry record",
    ("runtime/audit.py", "cached"): "the audit's own report record",
    ("runtime/audit.py", "events"): "the audit's own report record",
    ("runtime/audit.py", "freed_at"): "the audit's own replay record of a tier",
    ("runtime/audit.py", "owner"): "the audit's own replay record of a tier",
    ("runtime/audit.py", "problems"): "the audit's own report record",
    ("runtime/audit.py", "owners"): "the audit's own report record",
    ("runtime/audit.py", "pins"): "the audit's own report record",
    ("runtime/audit.py", "runs"): "the audit's own report record",
    ("runtime/completion.py", "finished"): "the bridge's own waiter record",
    ("runtime/completion.py", "timer"): "the bridge's own waiter record",
    ("runtime/events/hub.py", "_subscriptions"): _FRIEND,
    ("runtime/integrations/hf_hybrid.py", "_hicache_hook"): _HF,
    ("runtime/integrations/hf_hybrid.py", "_hicache_rec"): _HF,
    ("runtime/integrations/hf_hybrid.py", "_hicache_state_hook"): _HF,
    ("runtime/integrations/hf_hybrid.py", "forward"): _HF,
    ("runtime/integrations/hf_hybrid.py", "run"): "the hybrid model's own hook object",
    ("runtime/integrations/hf_llama.py", "_attn_implementation"): _HF,
    ("runtime/integrations/hf_llama.py", "hf_quantizer"): _HF,
    ("runtime/integrations/hf_llama.py", "quantization_config"): _HF,
    ("runtime/integrations/hf_mla.py", "_attn_implementation"): _HF,
    ("runtime/integrations/hf_mla.py", "forward"): _HF,
    **{("runtime/integrations/serving.py", a): _SERVING for a in (
        "snapshot_at", "device_tokens", "generated_tokens", "host_tokens", "latency_s", "queue_s",
        "recomputed_tokens", "resume_cached_tokens", "resume_recomputed_tokens", "storage_tokens", "tokens_per_s",
        "kv_len", "readiness", "slots", "start", "state_from", "state_slot", "t_first", "ttft_s",
        "prefill_s", "generated", "logits",
        "admissions")},
    ("runtime/timeline.py", "args"): "the converter's own trace event records",
    ("runtime/timeline.py", "events"): "the converter's own run records",
    ("runtime/integrations/vllm/events.py", "learning"): "the connector's own page record",
    ("runtime/integrations/vllm/events.py", "media"): "the connector's own page record",
    ("runtime/runtime.py", "state"): "the façade sets its supervisor's state on a failed start (to become a "
                                     "Supervisor method)",
    ("runtime/storage/mooncake_backend.py", "replica_num"): "Mooncake's replicate config object, built here",
    ("runtime/transfer/fake_engine.py", "next_layer"): _ENGINE_OP,
    **{("runtime/tree/cache.py", a): "the request and session records (runtime/tree/records.py) the core owns"
       for a in ("committed_len", "seq_len")},
    **{("runtime/tree/tiers/copies.py", a): _RECORD for a in ("orphaned", "backed_up", "failed", "failed_users", "users")},
    **{("runtime/tree/radix.py", a): _NODE for a in (
        "last_access", "priority", "lock_ref", "device", "hit_count", "host", "host_protect", "_dq", "_hq", "key", "children",
        "parent", "n_dev_children", "n_host_children")},
    **{("runtime/tree/radix.py", a): _LOOK for a in ("last_device_node", "last_node", "partial")},
    **{("runtime/tree/tiers/storage.py", a): _RECORD for a in (
        "anchor_host", "anchor_host_len", "anchor_lock", "by_prepare", "cancelled", "detached", "host", "link",
        "op_id", "tokens")},
    **{("runtime/tree/records.py", a): "a request record is a view of its row of the request table: it writes "
                                       "its lengths there (records.py and request_table.py: one part in two modules)"
       for a in ("seq_len_at", "committed_at", "num_slots_at")},
    ("runtime/tree/request_table.py", "row"): "the table files a record at its row (records.py: its one writer "
                                              "of row and table)",
    ("runtime/tree/request_table.py", "table"): "the table files a record at its row",
    ("runtime/integrations/vllm/core.py", "finished"): _RECORD,
    ("runtime/integrations/vllm/core.py", "copies"): _RECORD,
    ("runtime/integrations/vllm/core.py", "on_split"): _SPLIT,
}
WRITES_RATCHET = 99  # len(WRITES) may only go down

PRIVATE_READS: dict[tuple[str, str], str] = {
    ("runtime/completion.py", "_loop"): "asyncio's own loop attribute of a future (no public accessor)",
    ("runtime/events/hub.py", "_subscriptions"): _FRIEND,
    ("runtime/events/hub.py", "_offer"): _FRIEND,
    ("runtime/runtime.py", "_register_metrics"): "CacheRuntime.open on the instance it makes (its own class)",
    ("runtime/runtime.py", "_start_metrics"): "CacheRuntime.open on the instance it makes (its own class)",
    ("runtime/runtime.py", "_sup"): "CacheRuntime.open on the instance it makes (its own class)",
    ("runtime/storage/mooncake_backend.py", "_teardown_now"): "the module's atexit hook tears down its own "
                                                              "class's backends",
    ("runtime/storage/mooncake_cluster.py", "_exit"): "os._exit: the standard library's immediate exit (a "
                                                      "child whose parent died)",
    ("runtime/transfer/cuda_engine.py", "_forget"): _FRIEND,
    ("runtime/transfer/fake_engine.py", "_complete"): _FRIEND,
    ("runtime/tree/radix.py", "_dq"): _NODE,
    ("runtime/tree/radix.py", "_hq"): _NODE,
}
PRIVATE_READS_RATCHET = 12  # len(PRIVATE_READS) may only go down


# -- the tests -----------------------------------------------------------------------------------
def test_imports_go_down_the_layers():
    assert import_violations(ROOT) == []


def test_no_part_writes_or_peeks_into_another_outside_the_allow_list():
    bad, used = ownership_violations(ROOT, WRITES, PRIVATE_READS)
    assert bad == [], "\n".join(bad)
    stale = sorted(({("write", *k) for k in WRITES} | {("private-read", *k) for k in PRIVATE_READS}) - used)
    assert stale == [], f"fixed: remove these allow-list entries (and lower the ratchet): {stale}"
    assert len(WRITES) <= WRITES_RATCHET and len(PRIVATE_READS) <= PRIVATE_READS_RATCHET


def test_token_ledgers_change_owners_only_in_residency():
    assert ledger_calls(ROOT) == []
    assert all((ROOT / f).exists() for f in LEDGER_CALLS), "a listed file is gone: remove it"


def _plant(tmp_path: Path, module: str, source: str) -> Path:
    path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in path.relative_to(tmp_path).parents:
        if parent != Path("."):
            (tmp_path / parent / "__init__.py").touch()
    path.write_text(source)
    return path


def test_an_upward_import_is_found(tmp_path):
    """A tree module importing the actors (above it) fails the check; the same import under
    `if TYPE_CHECKING:`, or a downward one, does not."""
    _plant(tmp_path, "runtime.tree.planted", "from runtime.actors.base import Actor\nfrom runtime.memory import ledger\n")
    [found] = import_violations(tmp_path)
    assert "runtime.tree.planted (layer 5) imports runtime.actors.base (layer 6" in found
    _plant(tmp_path, "runtime.tree.planted",
           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.actors.base import Actor\n")
    _plant(tmp_path, "runtime.memory.rel", "from ..tree import radix\n")  # relative imports resolve too
    [found] = import_violations(tmp_path)
    assert "runtime.memory.rel (layer 1) imports runtime.tree" in found


def test_a_write_into_another_part_and_a_private_read_are_found(tmp_path):
    src = _plant(tmp_path, "runtime.tree.planted", (
        "class Part:\n"
        "    def __init__(self, other):\n"
        "        self.n = 0\n"  # own: fine
        "        self.n += 1\n"
        "        other.count = 1\n"  # another object's attribute
        "        other.count += 1\n"
        "        a, other.b = 1, 2\n"
        "        del other.gone\n"
        "        x = other._secret\n"  # a private read
        "        err = ValueError()\n"
        "        err.__cause__ = None\n"  # a dunder: Python's protocol, left out
        "        self._mine = self._mine\n"))
    found = sorted((kind, attr, line) for kind, _, attr, line in ownership_findings(src, "planted.py"))
    assert found == [("private-read", "_secret", 9), ("write", "b", 7), ("write", "count", 5),
                     ("write", "count", 6), ("write", "gone", 8)]
    bad, used = ownership_violations(tmp_path, {("runtime/tree/planted.py", "count"): "why"}, {})
    assert used == {("write", "runtime/tree/planted.py", "count")} and len(bad) == 3


def test_item_writes_and_mutating_calls_on_another_part_are_found(tmp_path):
    """A write of an item of another object's attribute, a deletion or augmentation of one, and a
    mutating method called on one are writes of that attribute; the same on `self`'s own
    attributes or on a local are not, and neither is numpy's read-only flag or os.environ."""
    src = _plant(tmp_path, "runtime.tree.planted", (
        "import os\n"
        "class Part:\n"
        "    def run(self, other, local):\n"
        "        other.table[3] = 1\n"
        "        del other.index[4]\n"
        "        other.counts[0][1] += 2\n"
        "        other.pending.append(5)\n"
        "        self.part.known.update({6})\n"  # another part's attribute, reached through self
        "        other.pages.fill(0)\n"
        "        self.mine[0] = 1\n"  # own
        "        self.mine.append(1)\n"
        "        local[0] = 1\n"  # a local's item, a local's method
        "        local.append(1)\n"
        "        other.arr.flags.writeable = False\n"
        "        os.environ['X'] = '1'\n"))
    found = sorted((attr, line) for kind, _, attr, line in ownership_findings(src, "planted.py") if kind == "write")
    assert found == [("counts", 6), ("index", 5), ("known", 8), ("pages", 9), ("pending", 7), ("table", 4)]


def test_a_write_into_a_ledger_from_the_storage_tier_fails_the_check(tmp_path):
    """The storage tier writing a ledger's page array (a subscript write into another part) fails
    the ownership check, which the real source passes: no write into the tree or a ledger from
    outside their owner is allowed."""
    source = (ROOT / "runtime/tree/tiers/storage.py").read_text()
    line = "        self.residency.host._codes[pages] = 0  # the ledger's owner array, written from here"
    planted = source.replace("    def restore(self, kept: StoredPages) -> None:\n",
                             f"    def planted(self, pages) -> None:\n{line}\n\n"
                             "    def restore(self, kept: StoredPages) -> None:\n", 1)
    assert planted != source and ownership_violations(ROOT, WRITES, PRIVATE_READS)[0] == []
    _plant(tmp_path, "runtime.tree.tiers.storage", planted)
    bad, _ = ownership_violations(tmp_path, WRITES, PRIVATE_READS)
    at = planted.splitlines().index(line) + 1
    assert f"runtime/tree/tiers/storage.py:{at}: write of another object's attribute '_codes'" in bad


def test_a_ledger_free_from_the_storage_tier_is_found(tmp_path):
    """The storage tier freeing host pages itself (not through Residency) fails the check; a
    group's own ledger (`self.ledger`) and Residency's are not findings."""
    _plant(tmp_path, "runtime.tree.tiers.storage", (
        "class StorageTier:\n"
        "    def drop(self, pages, owner):\n"
        "        self.residency.host.free(pages, owner)\n"
        "        res = self.residency\n"
        "        res.device.assign(pages, owner, owner)\n"))
    _plant(tmp_path, "runtime.tree.groups.planted", (
        "class Group:\n"
        "    def drop(self, slot, owner):\n"
        "        self.ledger.free(slot, owner)\n"))
    _plant(tmp_path, "runtime.tree.residency", (
        "class Residency:\n"
        "    def free_host(self, slots, owner):\n"
        "        self.host.free(slots, owner)\n"))
    assert ledger_calls(tmp_path) == [
        "runtime/tree/tiers/storage.py:3: host.free outside the ledger's owner",
        "runtime/tree/tiers/storage.py:5: device.assign outside the ledger's owner"]


@pytest.mark.parametrize("module", ["runtime.memory.ledger", "runtime.tree.cache", "runtime.actors.base",
                                    "runtime.integrations.vllm", "runtime"])
def test_every_module_has_a_layer(module):
    assert layer_of(module) is not None
