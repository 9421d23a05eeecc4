"""HiCache Runtime: a hierarchical KV cache for LLM serving, as an asyncio actor system."""

from runtime.config import RuntimeConfig
from runtime.errors import (
    ArgumentError,
    CallerError,
    CapacityError,
    ConfigError,
    DuplicateRequestError,
    HiCacheError,
    InternalError,
    InvariantViolation,
    LengthError,
    MailboxFull,
    OwnershipError,
    PinnedSlotError,
    RuntimeClosed,
    RuntimeFailed,
    StateError,
    TokenError,
    TransferError,
    UnknownRequestError,
    ValidationError,
)

__all__ = [
    "CacheRuntime", "RuntimeConfig", "ArgumentError", "CallerError", "CapacityError", "ConfigError", "DuplicateRequestError", "HiCacheError",
    "InternalError", "InvariantViolation", "LengthError", "MailboxFull", "OwnershipError", "PinnedSlotError", "RuntimeClosed", "RuntimeFailed",
    "StateError", "TokenError", "TransferError", "UnknownRequestError", "ValidationError",
]


def __getattr__(name: str):  # lazy: importing the package does not build torch state
    if name == "CacheRuntime":
        from runtime.runtime import CacheRuntime

        return CacheRuntime
    raise AttributeError(name)
