"""The machine's memory, as host pools are sized against it: what is available to new allocations
now, and the share of it the host tiers may take (the runtime at open, `runtime.assembly`; the vLLM
connector at start, `runtime.integrations.vllm.config`)."""

from __future__ import annotations

import os

MAX_HOST_SHARE = 0.9  # of available memory: the most host pools may take (the rest: the process, the OS)


def available_memory() -> int:
    """Bytes the kernel says are available to new allocations (``MemAvailable``), else free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(n: int) -> str:
    """`n` bytes in GiB, for a message."""
    return f"{n / 2**30:.2f} GiB"
