"""Prefill/decode disaggregation with the runtime: a prefill process and a decode process chat
with the demo model, the KV moving between them over Mooncake's Transfer Engine (TCP).

The decode process keeps its own tiers (device, host). Each turn it matches the conversation
against them; only the pages beyond that match are asked of the prefill process, which computes
the prompt's KV (its own tiers serve what it holds) and writes those pages straight into host
pages the decode process reserved. Per turn it prints the tokens matched on the decode side, the
tokens transferred and the time to first token; at the end it replays the same turns in one
process with one runtime and checks that every reply is the same, token for token.

    python examples/disagg.py --tiny            # a tiny random model (seconds)
    python examples/disagg.py                   # SmolLM2-135M-Instruct (the demo's model)

This process is the decode side; it starts the prefill side as a child (`--role prefill`).
Mooncake's Transfer Engine opens its listeners on every interface (whatever address it is
given): run it on a machine, or in a network namespace, where that is acceptable. The control
connection binds 127.0.0.1. Needs Mooncake (scripts/install_mooncake.sh). Tested in a network
namespace by tests/e2e/test_disagg_processes.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the demo's model and conversations
import demo  # noqa: E402  (puts the repository on the path too)

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.disagg.peer_backend import PeerBackend  # noqa: E402
from runtime.disagg.prefill_server import PrefillServer  # noqa: E402
from runtime.disagg.transport import MooncakeTransport  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, kv_geometry  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.storage.hashing import KVIdentity  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny random-weight Llama instead of SmolLM2")
    p.add_argument("--turns", type=int, default=4, help="turns of the conversation (at most 6)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--role", choices=("decode", "prefill"), default="decode", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)  # the prefill child writes its endpoint here
    p.add_argument("--model-cache", default=os.path.expanduser("~/.cache/hicache"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one RESULT line of JSON at the end (tests)")
    p.add_argument("--quick", action="store_true", help="two turns, short replies")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.max_new_tokens = 2, 8
    args.device, args.users = "cpu", 1
    return args


def runtime_config(model: Any, args: argparse.Namespace, **kw: Any) -> RuntimeConfig:
    layers, kv_heads, head_dim = kv_geometry(model.config)
    base = dict(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, page_size=16, device_slots=2048,
                host_tokens=4096, host_layout="page_first",
                model_id="tiny-llama" if args.tiny else "SmolLM2-135M-Instruct")
    base.update(kw)
    return RuntimeConfig(**base)


# -- the prefill side ------------------------------------------------------------------------------
async def prefill(args: argparse.Namespace) -> int:
    model, _tok, _eos, _name = demo.load_model(args)
    config = runtime_config(model, args)
    transport = MooncakeTransport()
    async with CacheRuntime.open(config) as rt:
        server = PrefillServer(rt, PagedKVModel(model, rt.device_pool), transport)
        async with server:
            Path(args.ready_file).write_text(server.endpoint)
            await asyncio.Event().wait()  # served until the decode side stops this process
    return 0


# -- the decode side -------------------------------------------------------------------------------
def start_prefill(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    ready = Path(tempfile.mkdtemp(prefix="hicache-disagg-")) / "endpoint"
    argv = [sys.executable, __file__, "--role", "prefill", "--ready-file", str(ready), "--seed", str(args.seed),
            "--model-cache", args.model_cache] + (["--tiny"] if args.tiny else [])
    child = subprocess.Popen(argv)
    deadline = time.monotonic() + 300
    while not ready.exists() or not ready.read_text():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise SystemExit(f"the prefill process did not start (exit {child.poll()})")
        time.sleep(0.1)
    return child, ready.read_text()


async def converse(srv: ServingLoop, conv: Any, questions: list[str], args: argparse.Namespace,
                   before: Any = None) -> list[tuple[list[int], Any]]:
    """The turns; per turn its prompt and completion (`before(prompt)`: called before each)."""
    out = []
    for q in questions:
        prompt = conv.prompt(q)
        if before is not None:
            before(prompt)
        c = await srv.generate(prompt, max_new_tokens=args.max_new_tokens, rid="chat")
        conv.reply(c)
        out.append((prompt, c))
    return out


async def decode_side(args: argparse.Namespace, endpoint: str) -> list[list[int]]:
    model, tok, eos, name = demo.load_model(args)
    config = runtime_config(model, args, prefetch_policy="wait_complete", storage_timeout_s=60.0)
    transport = MooncakeTransport()
    peer = await asyncio.to_thread(PeerBackend, endpoint, transport, KVIdentity.from_config(config), config.page_size,
                                   config.page_size * config.bytes_per_token, timeout_s=60.0)
    questions = list(demo.USERS.values())[0][:args.turns]
    print(f"decode side: {name}; prefill peer at {endpoint} (transfer engine session {peer.peer_session})")
    print(f"{'turn':>4} {'prompt':>7} {'matched':>8} {'sent':>6} {'ttft ms':>8}  reply")
    rows = []
    async with CacheRuntime.open(config, storage=peer) as rt, \
            ServingLoop(rt, PagedKVModel(model, rt.device_pool), eos_token_ids=eos) as srv:
        conv = demo.Conversation("ana", tok, __import__("random").Random(args.seed), model.config.vocab_size)
        marks: list[int] = []  # pages the peer had filled before each turn

        def expect(prompt: list[int]) -> None:
            marks.append(peer.counters["pages_filled"])
            peer.expect(prompt)

        turns = await converse(srv, conv, questions, args, expect)
        marks.append(peer.counters["pages_filled"])
        for turn, (prompt, c) in enumerate(turns, 1):
            m = c.metrics
            sent = (marks[turn] - marks[turn - 1]) * config.page_size
            text = tok.decode(c.tokens, skip_special_tokens=True).strip() if tok else str(c.tokens[:8])
            print(f"{turn:>4} {len(prompt):>7} {m.device_tokens + m.host_tokens:>8} {sent:>6} "
                  f"{1000 * (m.queue_s + m.prefill_s):>8.1f}  {text[:60]}")
            rows.append({"prompt": len(prompt), "matched": m.device_tokens + m.host_tokens, "sent": sent,
                         "from_peer": m.storage_tokens, "recomputed": m.recomputed_tokens, "tokens": c.tokens})
        storage = (await rt.stats())["storage"]
        print(f"decode side: {storage['read_pages']} pages read from the peer, {storage['rejected_pages']} refused "
              f"(tags), peer {peer.stats()}")
    peer.close()
    transport.close()
    return rows


async def one_process(args: argparse.Namespace) -> list[list[int]]:
    """The same turns with one runtime, no peer: the reference."""
    model, tok, eos, _name = demo.load_model(args)
    async with CacheRuntime.open(runtime_config(model, args)) as rt, \
            ServingLoop(rt, PagedKVModel(model, rt.device_pool), eos_token_ids=eos) as srv:
        conv = demo.Conversation("ana", tok, __import__("random").Random(args.seed), model.config.vocab_size)
        turns = await converse(srv, conv, list(demo.USERS.values())[0][:args.turns], args)
    return [c.tokens for _p, c in turns]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "prefill":
        return asyncio.run(prefill(args))
    child, endpoint = start_prefill(args)
    try:
        rows = asyncio.run(decode_side(args, endpoint))
    finally:
        child.terminate()
        child.wait(timeout=30)
    reference = asyncio.run(one_process(args))
    equal = [r["tokens"] for r in rows] == reference
    print(f"replies equal to one process, token for token: {'yes' if equal else 'NO'}")
    print(f"tokens sent {sum(r['sent'] for r in rows)} of {sum(r['prompt'] for r in rows)} prompt tokens")
    if args.json:
        print("RESULT " + json.dumps({"equal": equal, "rows": [{k: v for k, v in r.items() if k != "tokens"}
                                                                 for r in rows]}))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
