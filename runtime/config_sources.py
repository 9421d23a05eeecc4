"""Reading a `RuntimeConfig` from outside: a dict, the environment, a JSON or TOML file.

The dataclass itself keeps typed values (ints for byte counts, real bools); everything a
deployment writes as text is converted here, field by field, from the field's annotation:

- int / float fields take their type or a string of it (`"16"`, `"2.5"`); a bool or a float is
  not taken for an int field (a `16.0` page size is a mistake, not a 16);
- bool fields take a bool or one of `true/false/1/0/yes/no/on/off` (any case);
- optional fields (`X | None`) take `None` or the string `none` / `null` (any case);
- byte-valued fields (the names ending in `_bytes`) take an int, an integral float (JSON's
  `8e9`) or a size string: `"4096"`, `"8GiB"`, `"512 MiB"`, `"1.5GB"` (`parse_size`).

Every problem is a `ConfigError` naming the field (and the environment variable or file it came
from) and the value; unknown names are refused with the nearest field name suggested. Range and
cross-field checks stay in `RuntimeConfig.__post_init__`, the one place that validates.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
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
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE)


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
    text = value.strip()
    if text.startswith("-"):
        raise ConfigError(f"{field} must not be negative, got {value!r}")
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{field} must be a byte count or a size such as '8GiB' or '1.5GB', got {value!r}")
    number, unit = match.groups()
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


def _convert(kind: _FieldKind, value: object, where: str) -> object:
    """`value` as the field's typed value; `where` names the field (and its source) in errors."""
    if value is None or (kind.optional and isinstance(value, str) and value.strip().lower() in _NULL):
        if not kind.optional:
            raise ConfigError(f"{where} may not be null")
        return None
    if kind.size:
        return parse_size(value, where)
    if kind.scalar is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{where} must be a bool (true/false/1/0/yes/no/on/off), got {value!r}")
    if kind.scalar is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip(), 10)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if kind.scalar is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                pass
        elif isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


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
        merged[name] = _convert(kinds[name], environ[var], f"{name} (from {var}={environ[var]!r})")
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
                data = json.load(fh, object_pairs_hook=_no_duplicate_keys)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc}") from exc
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid {suffix[1:].upper()}: {exc}") from exc
    return config_from_dict(cls, data, f" (in {p.name})")  # type: ignore[arg-type]  # checked there


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:  # json keeps the last silently; TOML refuses duplicates, so do we
            raise ConfigError(f"config field {key!r} is given twice")
        out[key] = value
    return out
