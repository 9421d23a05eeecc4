"""Embedding HiCache Runtime: requests through the lifecycle API, one at a time (tiny model, CPU).

For queueing, batching and per-turn metrics use runtime.integrations.serving.ServingLoop
(see examples/demo.py). Takes no options.
"""
import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from runtime import CacheRuntime, RuntimeConfig  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, PagedSeq, kv_geometry, tiny_llama  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402


async def generate(rt, model, rid, prompt, max_new=8):
    res = await rt.admit(rid, prompt)  # a slot for every prompt token; the prefix found cached
    for r in res.readiness:  # host->device loads of that prefix (or r.wait(layer), layer by layer)
        await r.wait_all()
    tokens, slots, start = list(prompt), res.slots, res.cached
    for _ in range(max_new):  # the model writes the KV of tokens[start:] into the pool at `slots`
        logits = model([PagedSeq(slots, start, tokens[start:])]).logits[0]
        tokens.append(int(logits.argmax()))
        start = len(slots)
        slots = torch.cat((slots, await rt.extend(rid, 1)))  # a slot for the token just sampled
    await rt.finish(rid, tokens[:-1])  # tokens whose KV is written: not the last one sampled
    print(f"{rid}: prompt {len(prompt)} tokens, {res.cached_device} from device, {res.loaded_host} from host, "
          f"{len(prompt) - res.cached} computed -> {tokens[len(prompt):]}")


async def main():
    llama = tiny_llama()
    layers, kv_heads, head_dim = kv_geometry(llama.config)
    config = RuntimeConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, device_slots=1024)
    async with CacheRuntime.open(config) as rt:
        model = PagedKVModel(llama, rt.device_pool)
        system = list(range(10, 74))  # a 64-token prefix both requests share
        await generate(rt, model, "first", system + [5, 6, 7])
        await generate(rt, model, "second", system + [8, 9])  # its prefix comes from the device pool
        st = await rt.stats()
        print({tier: st[tier]["hit_tokens"] for tier in ("device", "host")}, "recomputed:",
              st["requests"]["recomputed_tokens"])


if __name__ == "__main__":
    configure_logging()  # the application's choice: the library never configures structlog
    asyncio.run(main())
