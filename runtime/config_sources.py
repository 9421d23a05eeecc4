"""Reading a `RuntimeConfig` from outside: a dict, the environment, a JSON or TOML file.

The dataclass itself keeps typed values (ints for byte counts, real bools); everything a
deployment writes as text is converted here, field by field, from the field's annotation:

- int fields take an int or a string of ASCII digits with an optional leading `-` (`"16"`; no
  `+`, underscores, spaces or other scripts' digits: `"1_6"`, `" 16 "`, `"１６"` are refused),
  within the signed 64-bit range; a bool or a float is not taken for an int field (a `16.0` page
  size is a mistake, not a 16);
- float fields take a finite int or float, or a plain ASCII decimal string (`"2.5"`, `"1e-3"`);
  `inf`, `nan` (JSON's `Infinity` / `NaN` too) are refused;
- bool fields take a bool; from the environment also one of `true/false/1/0/yes/no/on/off`
  (any case), and nowhere else a string (`decode_offload: "yes"` in a file is refused);
- optional fields (`X | None`) take `None` or the string `none` / `null` (any case); but
  `storage_key` (a secret) takes `None` or a key: text that holds none (empty, blank, `none`,
  `null`) is refused rather than read as "no key", which would silently turn the MAC off;
- byte-valued fields (the names ending in `_bytes`) take an int, an integral float (JSON's
  `8e9`) or a size string: `"4096"`, `"8GiB"`, `"512 MiB"`, `"1.5GB"` (`parse_size`).

msgspec's lax conversion is not used for this: it reads `"16.0"` and `16.0` as the int 16,
`"inf"` as a float and ints of any length. `check_types` applies the same types to a
`RuntimeConfig` built in code (its `__post_init__`), so every way in refuses the same values.

Every problem is a `ConfigError` naming the field (and the environment variable or file it came
from) and the value; unknown names are refused with the nearest field name suggested. Range and
cross-field checks stay in `RuntimeConfig.__post_init__`, the one place that validates.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.config import RuntimeConfig

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NULL = frozenset({"none", "null"})

# Decimal (SI) and binary (IEC) units, matched without regard to case: "8gb" is 8 * 10**9,
# "8GiB" 8 * 2**30. No bare "K"/"M"/"G": whether they mean 10**3 or 2**10 differs by tool.
SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_UNIT_NAMES = ("B", "KB", "MB", "GB", "TB", "PB", "KiB", "MiB", "GiB", "TiB", "PiB")
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+) ?([a-z]*)", re.IGNORECASE)  # [0-9]: ASCII digits only
# Numbers given as text: ASCII only (str.isdigit and `\d` also match other scripts' digits), no
# spaces, underscores or `+` (which int() and float() accept); ints within int64
INT_MAX = 2**63 - 1
_INT_RE = re.compile(r"-?[0-9]{1,19}")
_FLOAT_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?")
_SECRET_FIELDS = frozenset({"storage_key"})  # a value never put into a message
# why a secret's text is refused (`no_key_text`); the value itself is never in the message
NO_KEY = ("is set but holds no key (empty, blank, or a word for no value); give the key, or leave it "
          "unset for unkeyed page tags (its value is not shown)")


def no_key_text(value: object) -> bool:
    """`value` is text that holds no key: empty, blank, or a null word (`none` / `null`, any case
    and spacing). An optional field reads a null word as None; a secret refuses it instead (a key
    set to "none" must not quietly mean unkeyed)."""
    return isinstance(value, str) and value.strip().lower() in _NULL | {""}


def parse_size(value: object, field: str = "size") -> int:
    """Bytes from an int, an integral float or a size string (`"8GiB"`, `"1.5GB"`, `"4096"`).

    Negative sizes, fractional bytes (`"0.5B"`, `"1.0000001KiB"`) and unknown units are a
    `ConfigError` naming `field`."""
    if isinstance(value, bool):
        raise ConfigError(f"{field} must be a byte count or a size such as '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field} must not be negative, got {value!r}")
        return value
    if isinstance(value, float):
        if not value.is_integer() or value < 0:
            raise ConfigError(f"{field} must be a whole, non-negative number of bytes, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(f"{field} must be a byte count or a size such as '8GiB', got {value!r}")
    text = value
    if text.startswith("-"):
        raise ConfigError(f"{field} must not be negative, got {value!r}")
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{field} must be a byte count or a size such as '8GiB' or '1.5GB', got {value!r}")
    number, unit = match.groups()
    if len(number) > 200:  # (Fraction would hit Python's limit on int digits: an untyped ValueError)
        raise ConfigError(f"{field}: the number in {value!r:.60} is too long")
    scale = SIZE_UNITS.get(unit.lower() or "b")
    if scale is None:
        raise ConfigError(f"{field} has an unknown unit {unit!r} in {value!r} (units: {', '.join(_UNIT_NAMES)})")
    nbytes = Fraction(number) * scale  # exact: "1.1GB" is 1_100_000_000, not a float's neighbour
    if nbytes.denominator != 1:
        raise ConfigError(f"{field} is not a whole number of bytes: {value!r} is {float(nbytes)} bytes")
    return int(nbytes)


@dataclass(frozen=True, slots=True)
class _FieldKind:
    """How text and loose values convert to one field: its scalar type, optional or not, bytes or not."""

    name: str
    scalar: type  # int, float, bool or str
    optional: bool
    size: bool


@functools.cache
def _field_kinds(cls: type) -> dict[str, _FieldKind]:
    hints = typing.get_type_hints(cls)
    kinds: dict[str, _FieldKind] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        scalars = [a for a in args if a is not type(None)]
        if len(scalars) != 1 or scalars[0] not in (int, float, bool, str):
            raise TypeError(f"RuntimeConfig.{f.name}: no text conversion for {hint!r}")  # a new field's type
        kinds[f.name] = _FieldKind(f.name, scalars[0], len(args) > len(scalars), f.name.endswith("_bytes"))
    return kinds


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _LongInt(str):
    """A JSON integer literal longer than any int field takes (kept as its digits, refused by the
    field it is given to: Python's own limit would fail the whole parse with an untyped error)."""

    def __repr__(self) -> str:
        return f"an integer of {len(self.lstrip('-'))} digits"


def _json_int(text: str) -> int | _LongInt:
    return int(text) if len(text) <= 20 else _LongInt(text)


def _shown(kind: _FieldKind, value: object) -> str:
    """`value` for an error message: never a secret's, and an int too long to print by its size."""
    if kind.name in _SECRET_FIELDS:
        return "(its value is not shown)"
    if type(value) is int and not -INT_MAX - 1 <= value <= INT_MAX:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _typed(kind: _FieldKind, value: object) -> bool:
    """`value` is already of the field's type (the dataclass's own values)."""
    if value is None:
        return kind.optional
    if kind.scalar is int:
        return type(value) is int and -INT_MAX - 1 <= value <= INT_MAX
    if kind.scalar is float:  # (an int is a number too)
        return -INT_MAX - 1 <= value <= INT_MAX if type(value) is int else type(value) is float and math.isfinite(value)
    return type(value) is kind.scalar


def _convert(kind: _FieldKind, value: object, where: str, text_bools: bool = False) -> object:
    """`value` as the field's typed value; `where` names the field (and its source) in errors;
    `text_bools`: a bool field also takes the environment's strings (true/false/1/0/yes/no/on/off)."""
    if kind.name in _SECRET_FIELDS and no_key_text(value):
        raise ConfigError(f"{where} {NO_KEY}")
    if value is None or (kind.optional and isinstance(value, str) and value.strip().lower() in _NULL):
        if not kind.optional:
            raise ConfigError(f"{where} may not be null")
        return None
    if kind.size:
        return parse_size(value, where)
    if _typed(kind, value):
        return float(value) if kind.scalar is float else value
    if kind.scalar is bool:
        if text_bools and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        spelled = " (true/false/1/0/yes/no/on/off in the environment)" if text_bools else " (true or false)"
        raise ConfigError(f"{where} must be a bool{spelled}, got {value!r}")
    if kind.scalar is int:
        if isinstance(value, str) and not isinstance(value, _LongInt) and _INT_RE.fullmatch(value) \
                and -INT_MAX - 1 <= int(value) <= INT_MAX:
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {_shown(kind, value)} (ASCII digits, 64-bit)")
    if kind.scalar is float:
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value) and math.isfinite(float(value)):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {_shown(kind, value)} (finite; ASCII digits)")
    raise ConfigError(f"{where} must be a string, got {_shown(kind, value)}")


def check_types(config: object) -> None:
    """Every field of a dataclass built in code holds its type: ints within int64, finite floats
    (ints taken), bools as bools, strings, None only where optional. A `ConfigError` naming the
    first field that does not."""
    for kind in _field_kinds(type(config)).values():
        value = getattr(config, kind.name)
        if not _typed(kind, value):
            want = {int: "an integer", float: "a number", bool: "a bool", str: "a string"}[kind.scalar]
            why = {int: " (64-bit)", float: " (finite)", bool: " (True or False)", str: ""}[kind.scalar]
            raise ConfigError(f"{kind.name} must be {want}{' or None' if kind.optional else ''}, "
                              f"got {_shown(kind, value)}{why}")


def config_from_dict(cls: type[RuntimeConfig], data: Mapping[str, object], source: str = "") -> RuntimeConfig:
    """`cls(**converted)`: every key must be a field; `source` (" (in FILE)") goes into errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of field names to values{source}, got {type(data).__name__}")
    kinds = _field_kinds(cls)
    values: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):  # flat on purpose: one name per knob, the same in a file, a dict and the env
            raise ConfigError(f"{key!r}{source} is a nested table; RuntimeConfig is flat: give its fields at the "
                              f"top level")
        if not isinstance(key, str) or key not in kinds:
            raise ConfigError(f"unknown config field {key!r}{source}{_suggest(str(key), list(kinds))}")
        values[key] = _convert(kinds[key], value, f"{key}{source}")
    try:
        return cls(**values)
    except ConfigError as exc:
        if not source:
            raise
        raise ConfigError(f"{exc}{source}") from None


def config_from_env(cls: type[RuntimeConfig], environ: Mapping[str, str], prefix: str,
                    base: RuntimeConfig | Mapping[str, object] | None) -> RuntimeConfig:
    """`base` (a config or a dict, default: the defaults) overridden by every `PREFIX<FIELD>` variable;
    a prefixed variable that names no field is an error (a typo must not vanish)."""
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError(f"prefix must be a non-empty string, got {prefix!r}")
    kinds = _field_kinds(cls)
    if base is None:
        merged: dict[str, object] = {}
    elif isinstance(base, cls):
        merged = base.to_dict()
    elif isinstance(base, Mapping):
        merged = dict(base)  # checked with the rest below
    else:
        raise ConfigError(f"base must be a RuntimeConfig, a mapping or None, got {type(base).__name__}")
    for var in sorted(environ):
        if not var.startswith(prefix):
            continue
        name = var[len(prefix):].lower()
        if name not in kinds:
            known = [prefix + n.upper() for n in kinds]
            raise ConfigError(f"environment variable {var} names no config field{_suggest(var, known)}")
        shown = var if name in _SECRET_FIELDS else f"{var}={environ[var]!r}"
        merged[name] = _convert(kinds[name], environ[var], f"{name} (from {shown})", text_bools=True)
    return config_from_dict(cls, merged)


def config_from_file(cls: type[RuntimeConfig], path: str | os.PathLike[str]) -> RuntimeConfig:
    """A flat `.json` object or `.toml` document of field names (by the file's suffix)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ConfigError(f"config file {str(p)!r} must end in .json or .toml, not {p.suffix or 'no suffix'!r}")
    try:
        if suffix == ".toml":
            with p.open("rb") as fh:
                data: object = tomllib.load(fh)
        else:
            with p.open("r", encoding="utf-8") as fh:
                data = json.load(fh, object_pairs_hook=_no_duplicate_keys, parse_int=_json_int)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc}") from exc
    except (tomllib.TOMLDecodeError, ValueError) as exc:  # (JSONDecodeError, UnicodeDecodeError: ValueErrors)
        raise ConfigError(f"config file {str(p)!r} is not valid {suffix[1:].upper()}: {exc}") from exc
    return config_from_dict(cls, data, f" (in {p.name})")  # type: ignore[arg-type]  # checked there


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:  # json keeps the last silently; TOML refuses duplicates, so do we
            raise ConfigError(f"config field {key!r} is given twice")
        out[key] = value
    return out
