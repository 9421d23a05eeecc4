"""The runtime's host and storage tiers as a vLLM v1 KV connector (tiers-only mode; vLLM 0.33).

vLLM loads the connector from this package (``"kv_connector": "HiCacheConnector",
"kv_connector_module_path": "runtime.integrations.vllm"``; docs/VLLM.md has every option). The
parts, each with one owner of its state:

- `connector`: `HiCacheConnector`, the façade vLLM calls, handing each call to its role's side;
- `scheduler`: the scheduler side (vLLM's scheduler process) over `core`'s `TiersOnlyCore`;
- `worker`: the worker side (the host pool, the copies, the storage calls);
- `messages`: what the two sides send each other; `config`: the options; `metrics`: vLLM's
  metrics; `events`: KV events; `invariants`: `check_tiers_only`, the core's invariants.

The façade's names are resolved on first use: `core`, `config` and `invariants` import without
vLLM (the core's own tests and the options' checks run where vLLM is not installed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.integrations.vllm.connector import CopyAcks, HiCacheConnector, LoadJob, TieredMeta

__all__ = ["HiCacheConnector", "TieredMeta", "LoadJob", "CopyAcks"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("runtime.integrations.vllm.connector"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
