"""The library logs as a library: structlog bound to stdlib `logging` loggers (``hicache.*``),
governed by the application's `logging` set-up (`runtime.trace.get_logger`).

Each case runs in a fresh interpreter (the test process configured logging for itself), embedding
the runtime: open, admit, finish, close."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_EMBED = textwrap.dedent("""
    import asyncio, logging, sys
    sys.path.insert(0, sys.argv[1])
    if sys.argv[2] == "debug":
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    import numpy as np
    from runtime.config import RuntimeConfig
    from runtime.runtime import CacheRuntime

    async def main():
        async with CacheRuntime.open(RuntimeConfig(device_slots=256, host_tokens=512, page_size=4)) as rt:
            tokens = np.arange(1, 30, dtype=np.int32)
            adm = await rt.admit("r1", tokens)
            await rt.finish("r1", tokens)

    asyncio.run(main())
""")


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _EMBED, str(ROOT), mode], capture_output=True, text=True,
                          timeout=120)


def test_an_application_that_configured_no_logging_sees_nothing():
    out = _run("none")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "" and out.stderr == "", (out.stdout[-2000:], out.stderr[-2000:])


def test_an_application_at_debug_sees_the_runtimes_events():
    out = _run("debug")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == ""
    lines = [line for line in out.stderr.splitlines() if line.startswith("DEBUG:hicache.")]
    # the ledger's slot events, through the `hicache.slots` logger, as stdlib records
    assert any(line.startswith("DEBUG:hicache.slots:alloc tier='device'") for line in lines), out.stderr[-3000:]
