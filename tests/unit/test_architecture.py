"""The package's structure, checked over the source (AST, no import): who may write an attribute,
who may read a private one, and which way imports go (docs/ARCHITECTURE.md, "Import direction").

- Ownership: a module writes (assigns, augments, deletes) only attributes of `self` / `cls`, and
  reads attributes starting with `_` only of `self` / `cls`. Dunders (`exc.__cause__`) are Python's
  protocol, not a part's state, and are left out. What does not follow the rule yet is listed in
  `WRITES` / `PRIVATE_READS` below, each entry with its reason; the lists may only shrink (a fixed
  entry must go: an entry no longer used fails, and so does a list longer than its ratchet).
- Import direction: a module imports only modules of its own layer or below (`LAYERS`); imports
  under `if TYPE_CHECKING:` are annotations, not dependencies, and are left out.

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


def ownership_findings(path: Path, rel: str) -> Iterator[tuple[str, str, str, int]]:
    """("write" | "private-read", file, attribute, line) for every write of another object's
    attribute and every read of another object's `_` attribute in the file at `path`."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        while targets:
            t = targets.pop()
            if isinstance(t, ast.Tuple | ast.List):
                targets.extend(t.elts)
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif isinstance(t, ast.Attribute) and not _own(t.value) and not _dunder(t.attr):
                yield "write", rel, t.attr, t.lineno
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


# Writes of another part's attribute that are there today, by file and attribute, with the reason.
# The list may only shrink: remove an entry when you fix it (and lower `WRITES_RATCHET`).
_RECORD = "a plain record (dataclass) of this module's part: the part is its one writer"
_NODE = "Node is the radix tree's plain value type (runtime/tree/nodes.py): RadixTree is its one writer"
_LOOK = "a MatchResult the tree builds and fills in the same call"
_ENGINE_OP = "the engine's own in-flight op record"
_HF = "patches the Hugging Face model it wraps (its hooks and attention implementation)"
_SERVING = "the demo scheduler's own request and metrics records"
_NUMPY = "numpy's read-only flag on an array this module made"
_STORAGE_TIER = "the storage tier's state set from outside it: to become StorageTier methods"
_SPLIT = "the split hook is an attribute set by the core (to become a declared hook of the parts)"
WRITES: dict[tuple[str, str], str] = {
    ("runtime/actors/offload_actor.py", "finished"): "the offload actor's per-request progress record",
    ("runtime/actors/offload_actor.py", "offloaded"): "the offload actor's per-request progress record",
    ("runtime/actors/transfer_actor.py", "done"): "the transfer actor's in-flight entry record",
    ("runtime/actors/transfer_actor.py", "error"): "the transfer actor's in-flight entry record",
    ("runtime/actors/transfer_actor.py", "started"): "the transfer actor's in-flight entry record",
    ("runtime/actors/tree_actor.py", "paused"): _STORAGE_TIER,
    ("runtime/audit.py", "cached"): "the audit's own report record",
    ("runtime/audit.py", "events"): "the audit's own report record",
    ("runtime/audit.py", "owners"): "the audit's own report record",
    ("runtime/audit.py", "pins"): "the audit's own report record",
    ("runtime/audit.py", "runs"): "the audit's own report record",
    ("runtime/completion.py", "finished"): "the bridge's own waiter record",
    ("runtime/completion.py", "timer"): "the bridge's own waiter record",
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
        "prefill_s",
        "admissions")},
    ("runtime/integrations/vllm/events.py", "learning"): "the connector's own page record",
    ("runtime/integrations/vllm/events.py", "media"): "the connector's own page record",
    ("runtime/memory/ledger.py", "writeable"): _NUMPY,
    ("runtime/runtime.py", "state"): "the façade sets its supervisor's state on a failed start (to become a "
                                     "Supervisor method)",
    ("runtime/storage/mooncake_backend.py", "replica_num"): "Mooncake's replicate config object, built here",
    ("runtime/transfer/engine.py", "writeable"): _NUMPY,
    ("runtime/transfer/fake_engine.py", "next_layer"): _ENGINE_OP,
    **{("runtime/tree/cache.py", a): "the request and session records (runtime/tree/records.py) the core owns"
       for a in ("cached_len", "committed_len", "dups", "failed", "last_node", "seq_len", "tokens", "turn", "slots")},
    ("runtime/tree/cache.py", "requests"): "the sliding-window part reads the core's request records (to become "
                                           "an argument of its drop)",
    ("runtime/tree/cache.py", "on_split"): _SPLIT,
    ("runtime/tree/cache.py", "doubtful"): _STORAGE_TIER,
    ("runtime/tree/cache.py", "known"): _STORAGE_TIER,
    ("runtime/tree/cache.py", "known_states"): _STORAGE_TIER,
    ("runtime/tree/cache.py", "rank_keys"): _STORAGE_TIER,
    **{("runtime/tree/copies.py", a): _RECORD for a in ("orphaned", "backed_up", "failed", "failed_users")},
    ("runtime/tree/nodes.py", "owner"): "a Node's owner slot is set once, at its making",
    **{("runtime/tree/radix.py", a): _NODE for a in (
        "last_access", "priority", "lock_ref", "device", "hit_count", "host", "host_protect", "_dq", "_hq", "key",
        "parent", "n_dev_children", "n_host_children")},
    **{("runtime/tree/radix.py", a): _LOOK for a in ("last_device_node", "last_node", "partial")},
    ("runtime/tree/page_hasher.py", "page_hashes"): "the page hasher keeps a node's page hashes in the node "
                                                    "(one slot it alone writes; events and storage read it)",
    ("runtime/tree/radix.py", "writeable"): _NUMPY,
    ("runtime/tree/request_table.py", "row"): "the table files a record at its row (records.py: its one writer "
                                              "of row and table)",
    ("runtime/tree/request_table.py", "table"): "the table files a record at its row",
    ("runtime/tree/request_table.py", "writeable"): _NUMPY,
    **{("runtime/tree/storage_tier.py", a): _RECORD for a in (
        "anchor_host", "anchor_host_len", "anchor_lock", "by_prepare", "cancelled", "detached", "host", "link",
        "op_id", "tokens", "parents")},
    ("runtime/integrations/vllm/core.py", "finished"): _RECORD,
    ("runtime/integrations/vllm/core.py", "on_split"): _SPLIT,
}
WRITES_RATCHET = 105  # len(WRITES) may only go down

_FRIEND = "a helper class of the same module (one part in two classes)"
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
    ("runtime/tree/request_table.py", "_free_rows"): _FRIEND,
}
PRIVATE_READS_RATCHET = 13  # len(PRIVATE_READS) may only go down


# -- the tests -----------------------------------------------------------------------------------
def test_imports_go_down_the_layers():
    assert import_violations(ROOT) == []


def test_no_part_writes_or_peeks_into_another_outside_the_allow_list():
    bad, used = ownership_violations(ROOT, WRITES, PRIVATE_READS)
    assert bad == [], "\n".join(bad)
    stale = sorted(({("write", *k) for k in WRITES} | {("private-read", *k) for k in PRIVATE_READS}) - used)
    assert stale == [], f"fixed: remove these allow-list entries (and lower the ratchet): {stale}"
    assert len(WRITES) <= WRITES_RATCHET and len(PRIVATE_READS) <= PRIVATE_READS_RATCHET


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


@pytest.mark.parametrize("module", ["runtime.memory.ledger", "runtime.tree.cache", "runtime.actors.base",
                                    "runtime.integrations.vllm", "runtime"])
def test_every_module_has_a_layer(module):
    assert layer_of(module) is not None
