"""Caller values: what the façade checks before it sends anything (docs/API.md, "Caller values").

Every argument of a public call is checked here, in the calling coroutine, so that a bad value
is a `ValidationError` for that caller alone and never reaches an actor:

- ids (`rid`, session ids) and namespaces (`extra_key`) key the tree actor's dicts. A value
  whose hash or equality raises would crash the actor (and fail every caller); values that are
  equal but look different (``1 == 1.0 == True == np.int64(1)``) would share a namespace. Only
  plain keys pass: exact `str`, `bytes`, `int` (not `bool`, not numpy ints) and tuples of them
  (nested at most `MAX_KEY_DEPTH` deep); ids may also be `uuid.UUID`s, namespaces may be (or
  hold) `None`. Anything else is an `ArgumentError`.
- token ids are integers ``0 <= id < limit`` (``2**31``, or the config's `vocab_size`) in a 1-D
  integer numpy array, torch tensor, or a list / tuple / range of exact ints. Nothing is
  coerced: floats, bools, strings and objects are a `TokenError`, and so is an id out of range
  (an int64 id >= 2**31 used to wrap onto another prompt's int32 id). Empty, not 1-D or longer
  than the device pool is a `LengthError`.
- counts are exact ints (`LengthError` otherwise; the actor checks their range against the
  request), flags exact bools.
- `step` items are the public request messages (`STEP_ITEMS`) built with ``reply=None``, each
  field checked as for the single call.

The int32 numpy array is the fast path: one copy and one vectorised min (plus a max with a
`vocab_size`).
"""

from __future__ import annotations

import reprlib
import uuid
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch

from runtime.errors import ArgumentError, LengthError, TokenError
from runtime.messages import Abort, Admit, Cache, Commit, Extend, Finish

TOKEN_LIMIT = 1 << 31  # token ids are stored as int32
MAX_KEY_DEPTH = 8  # tuple nesting of a key; hashing deeper nests recurses in C for nothing a caller needs

_ID_ATOMS: frozenset[type] = frozenset((str, bytes, int, uuid.UUID))
_NAMESPACE_ATOMS: frozenset[type] = frozenset((type(None), str, bytes, int))
_INT32 = np.dtype(np.int32)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _tuple_ok(value: tuple[Any, ...], atoms: frozenset[type], depth: int) -> bool:
    if depth > MAX_KEY_DEPTH:
        return False
    for v in value:
        t = type(v)
        if t not in atoms and not (t is tuple and _tuple_ok(v, atoms, depth + 1)):
            return False
    return True


def check_id(value: Any, what: str = "rid") -> Hashable:
    """A request or session id: exact str, bytes, int or uuid.UUID, or a tuple of them."""
    t = type(value)
    if t in _ID_ATOMS or (t is tuple and _tuple_ok(value, _ID_ATOMS, 1)):
        return value
    raise ArgumentError(f"{what} must be a str, bytes, int (not bool), uuid.UUID or a tuple of them "
                        f"(at most {MAX_KEY_DEPTH} deep), got {_describe(value)}")


def check_optional_id(value: Any, what: str) -> Hashable:
    return None if value is None else check_id(value, what)


def check_namespace(value: Any) -> Hashable:
    """An `extra_key`: None, exact str, bytes or int, or a tuple of them."""
    t = type(value)
    if t in _NAMESPACE_ATOMS or (t is tuple and _tuple_ok(value, _NAMESPACE_ATOMS, 1)):
        return value
    raise ArgumentError(f"extra_key must be None, a str, bytes, int (not bool or a numpy int) or a tuple of "
                        f"them (at most {MAX_KEY_DEPTH} deep), got {_describe(value)}")


def check_count(value: Any, what: str) -> int:
    if type(value) is int:
        return value
    raise LengthError(f"{what} must be an int, got {_describe(value)}")


def check_optional_count(value: Any, what: str) -> int | None:
    return None if value is None else check_count(value, what)


def check_priority(value: Any) -> int:
    """An admit's eviction priority: an int (not a bool) in [0, 2**63)."""
    if type(value) is int and 0 <= value < 1 << 63:
        return value
    raise ArgumentError(f"priority must be an int in [0, 2**63), got {_describe(value)}")


def check_flag(value: Any, what: str) -> bool:
    if type(value) is bool:
        return value
    raise ArgumentError(f"{what} must be a bool, got {_describe(value)}")


def tokens(value: Any, limit: int = TOKEN_LIMIT, max_len: int | None = None) -> np.ndarray:
    """A new 1-D int32 array of the token ids in `value` (the message's own: the caller may reuse
    its buffer), every id in ``[0, limit)``; `max_len` bounds the length."""
    if type(value) is np.ndarray and value.dtype is _INT32 and value.ndim == 1:
        n = value.shape[0]
        if n and (max_len is None or n <= max_len):
            arr = value.copy()  # checked below: exactly what is sent
            # argmin/argmax are C methods with a third of ndarray.min/max's ufunc overhead; an
            # int32 id is < 2**31 anyway, so without a vocab_size only the sign is in question
            if arr[arr.argmin()] >= 0 and (limit >= TOKEN_LIMIT or arr[arr.argmax()] < limit):
                return arr
            _out_of_range(arr, limit)
    return _tokens_slow(value, limit, max_len)


def _tokens_slow(value: Any, limit: int, max_len: int | None) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        dt = value.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise TokenError(f"token ids must be integers, got a {dt} tensor")
        _check_shape(tuple(value.shape), max_len)
        try:  # int64 holds every integer dtype's ids (a uint64 id >= 2**63 turns negative: out of range)
            arr = value.detach().to("cpu", torch.int64).numpy()
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            raise TokenError(f"token tensor cannot be read as integers: {exc}") from None
    elif isinstance(value, np.ndarray):
        arr = value.view(np.ndarray)  # a subclass (memmap) as a plain array
        if arr.dtype.kind not in "iu":
            raise TokenError(f"token ids must be integers, got a {arr.dtype} array")
        _check_shape(arr.shape, max_len)
    elif type(value) is list or type(value) is tuple:
        _check_shape((len(value),), max_len)
        kinds = set(map(type, value))
        if kinds != {int}:
            bad = sorted(k.__name__ for k in kinds - {int})
            raise TokenError(f"token ids must be ints (not bool, float, str or numpy scalars), got {', '.join(bad)}")
        try:
            arr = np.array(value, dtype=np.int64)
        except OverflowError:
            raise TokenError(f"a token id is out of range [0, {limit})") from None
    elif type(value) is range:
        try:
            n = len(value)
        except OverflowError:  # more than sys.maxsize ids
            raise LengthError(f"{value!r} has too many tokens") from None
        _check_shape((n,), max_len)
        lo, hi = min(value[0], value[-1]), max(value[0], value[-1])
        if lo < 0 or hi >= limit:
            raise TokenError(f"token ids of {value!r} are out of range [0, {limit})")
        return np.arange(value.start, value.stop, value.step, dtype=np.int32)
    else:
        raise TokenError("tokens must be a 1-D integer numpy array or torch tensor, or a list, tuple or range "
                         f"of ints, got {type(value).__name__}")
    if (arr.dtype.kind == "i" and arr.min() < 0) or arr.max() >= limit:
        _out_of_range(arr, limit)
    return arr.astype(np.int32)


def _check_shape(shape: tuple[int, ...], max_len: int | None) -> None:
    if len(shape) != 1 or shape[0] == 0:
        raise LengthError(f"tokens must be a non-empty 1-D sequence of token ids, got shape {shape}")
    if max_len is not None and shape[0] > max_len:
        raise LengthError(f"{shape[0]} tokens exceed the device pool ({max_len} slots)")


def _out_of_range(arr: np.ndarray, limit: int) -> None:
    i = int(np.flatnonzero((arr < 0) | (arr >= limit))[0])
    raise TokenError(f"token id {arr[i]} at position {i} is out of range [0, {limit})")


# -- step items ---------------------------------------------------------------------------
# Each returns the item to send: the same object when no field needs copying, else a rebuild
# with the message's own token array (every other field as given).


def step_tokens(limit: int, max_len: int) -> Callable[[Any], np.ndarray]:
    """`tokens` for the items of one `step`: an array object given to several of them (a prompt
    to `Admit`, then to `Cache`) is checked and copied once, and they share the copy. Nothing
    runs between the items' checks, so the copy holds what a second one would."""
    seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def check(value: Any) -> np.ndarray:
        if type(value) is not np.ndarray:
            return tokens(value, limit, max_len)
        hit = seen.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        arr = tokens(value, limit, max_len)
        seen[id(value)] = (value, arr)  # `value` kept: its id is not reused during the step
        return arr

    return check


def _with_reply(item: Any) -> ArgumentError:
    return ArgumentError(f"a step item is built with reply=None (the step has one reply), got {type(item).__name__} "
                         "with a reply")


def admit_message(rid: Any, value: Any, extra_key: Any, session: Any, priority: Any, reply: Any, limit: int,
                  max_len: int) -> Admit:
    """`rt.admit`'s message, every argument checked (its tokens a new int32 array, `tokens`): the
    one check of an admit's input (the tree actor and its core take the message as it is)."""
    return Admit(check_id(rid), tokens(value, limit, max_len), check_namespace(extra_key),
                 None if session is None else check_id(session, "session"), check_priority(priority), reply=reply)


# The plain cases are tested inline (`type(x) in ATOMS`): a step checks several items per request.
def _admit(m: Admit, toks: Callable[[Any], np.ndarray]) -> Admit:
    if m.reply is not None:
        raise _with_reply(m)
    rid, ns, sid, prio = m.rid, m.extra_key, m.session, m.priority
    return Admit(rid if type(rid) in _ID_ATOMS else check_id(rid), toks(m.tokens),
                 ns if type(ns) in _NAMESPACE_ATOMS else check_namespace(ns),
                 None if sid is None else sid if type(sid) in _ID_ATOMS else check_id(sid, "session"),
                 0 if prio == 0 and type(prio) is int else check_priority(prio))


def _extend(m: Extend, toks: Callable[[Any], np.ndarray]) -> Extend:
    if m.reply is not None:
        raise _with_reply(m)
    if type(m.rid) not in _ID_ATOMS:
        check_id(m.rid)
    if type(m.num_tokens) is not int:
        check_count(m.num_tokens, "num_tokens")
    return m


def _commit(m: Commit, toks: Callable[[Any], np.ndarray]) -> Commit:
    if m.reply is not None:
        raise _with_reply(m)
    if type(m.rid) not in _ID_ATOMS:
        check_id(m.rid)
    if type(m.committed_len) is not int:
        check_count(m.committed_len, "committed_len")
    return m


def _cache(m: Cache, toks: Callable[[Any], np.ndarray]) -> Cache:
    if m.reply is not None:
        raise _with_reply(m)
    rid = m.rid
    return Cache(rid if type(rid) in _ID_ATOMS else check_id(rid), toks(m.tokens))


def _finish(m: Finish, toks: Callable[[Any], np.ndarray]) -> Finish:
    if m.reply is not None:
        raise _with_reply(m)
    rid, n = m.rid, m.finished_len
    return Finish(rid if type(rid) in _ID_ATOMS else check_id(rid), toks(m.tokens),
                  n if n is None or type(n) is int else check_count(n, "finished_len"))


def _abort(m: Abort, toks: Callable[[Any], np.ndarray]) -> Abort:
    if m.reply is not None:
        raise _with_reply(m)
    if type(m.rid) not in _ID_ATOMS:
        check_id(m.rid)
    return m


STEP_ITEMS: dict[type, Callable[[Any, Callable[[Any], np.ndarray]], Any]] = {
    Admit: _admit, Extend: _extend, Commit: _commit, Cache: _cache, Finish: _finish, Abort: _abort,
}


def step_item(item: Any, toks: Callable[[Any], np.ndarray]) -> Any:
    """The item to send for one `step` item (its token arrays checked by `toks`, from
    `step_tokens`), or a `ValidationError` raised."""
    check = STEP_ITEMS.get(type(item))
    if check is None:
        raise ArgumentError(f"a step item is one of {', '.join(t.__name__ for t in STEP_ITEMS)}, got {_describe(item)}")
    return check(item, toks)
