"""Property tests of the config surface: any valid RuntimeConfig survives the trip through a dict,
the environment (every value as text, sizes in random units), a JSON file and a TOML file; and
size strings parse to exactly the bytes they denote, or are refused when that is not whole.

Checked to be able to fail: with parse_size computing through float instead of Fraction, both
size-string tests fail within the default examples (e.g. "9007199254740993" read as 2**53); with
`_convert` reading "none" as None for every str field, the env round trip fails on model_id
"none"."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.config import (
    EVICTION_POLICIES,
    HOST_LAYOUTS,
    KV_DTYPES,
    PREFETCH_POLICIES,
    RuntimeConfig,
    STORAGE_BACKENDS,
    WRITE_POLICIES,
)
from runtime.config_sources import SIZE_UNITS, parse_size
from runtime.errors import ConfigError

NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./: "
names = st.text(NAME_CHARS, min_size=1, max_size=12)
# Optional str fields read "none"/"null" as None (documented), so their strings avoid those.
paths = st.one_of(st.none(), names.filter(lambda s: s.strip().lower() not in ("none", "null")))
sizes = st.one_of(st.none(), st.integers(0, 2**62))
floats = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])


@st.composite
def configs(draw) -> RuntimeConfig:
    ps = draw(st.sampled_from([1 << i for i in range(9)]))
    fields = dict(
        num_layers=draw(st.integers(1, 8)), num_kv_heads=draw(st.integers(1, 8)), head_dim=draw(st.integers(1, 64)),
        kv_dtype=draw(st.sampled_from(sorted(KV_DTYPES))),
        model_id=draw(st.one_of(st.just("none"), names)), weight_version=draw(names),
        page_size=ps, device_slots=ps * draw(st.integers(1, 64)),
        host_ratio=draw(floats), host_tokens=draw(st.one_of(st.none(), st.integers(0, 64).map(lambda k: k * ps))),
        host_bytes=draw(sizes), host_layout=draw(st.sampled_from(HOST_LAYOUTS)),
        write_policy=draw(st.sampled_from(WRITE_POLICIES)), write_through_threshold=draw(st.integers(1, 9)),
        eviction_policy=draw(st.sampled_from(EVICTION_POLICIES)),
        copy_engine=draw(st.sampled_from(["auto", "cpu", "fake"])), copy_workers=draw(st.integers(1, 9)),
        max_inflight_loads=draw(st.integers(1, 99)), max_queued_backups=draw(st.integers(1, 999)),
        decode_offload=draw(st.booleans()),
        offload_stride=draw(st.one_of(st.none(), st.integers(1, 8).map(lambda k: k * ps))),
        storage_backend=draw(st.sampled_from(STORAGE_BACKENDS)), storage_dir=draw(paths),
        storage_cap_bytes=draw(st.one_of(st.none(), st.integers(1, 2**62))),
        prefetch_policy=draw(st.sampled_from(PREFETCH_POLICIES)), prefetch_threshold=draw(st.integers(0, 10**6)),
        prefetch_timeout_base_s=draw(floats), prefetch_timeout_per_1k_s=draw(floats),
        prefetch_timeout_max_s=draw(floats), storage_timeout_s=draw(st.floats(1e-6, 1e6)),
        mailbox_capacity=draw(st.integers(1, 10**5)), debug_invariants=draw(st.booleans()),
        trace_path=draw(paths), vocab_size=draw(st.one_of(st.none(), st.integers(1, 2**31))),
    )
    try:
        return RuntimeConfig(**fields)
    except ConfigError:  # storage without a host tier, file backend without a directory
        return draw(st.nothing())


def exact_decimal(x: Fraction) -> str:
    """x (a non-negative fraction whose denominator is 2^a 5^b) as an exact decimal string."""
    digits = 0
    while (x * 10**digits).denominator != 1:
        digits += 1
    scaled = str(int(x * 10**digits)).rjust(digits + 1, "0")
    return scaled if digits == 0 else f"{scaled[:-digits]}.{scaled[-digits:]}"


def size_text(nbytes: int, unit: str, spell) -> str:
    """nbytes written exactly in `unit` (every unit's 1/scale is a finite decimal), in a random case."""
    number = exact_decimal(Fraction(nbytes, SIZE_UNITS[unit]))
    return f"{number}{spell(' ', '')}{spell(unit, unit.upper(), unit.lower())}" if unit != "b" else spell(number, f"{number}B")


def as_env_text(kind_value: object, name: str, draw) -> str:
    spell = lambda *options: draw(st.sampled_from(options))  # noqa: E731
    if kind_value is None:
        return spell("none", "None", "NULL")
    if isinstance(kind_value, bool):
        return spell("true", "TRUE", "1", "yes", "on") if kind_value else spell("false", "False", "0", "no", "off")
    if name.endswith("_bytes"):
        return size_text(kind_value, draw(st.sampled_from(sorted(SIZE_UNITS))), spell)
    return repr(kind_value) if isinstance(kind_value, float) else str(kind_value)


def toml_text(d: dict[str, object]) -> str:
    """A flat TOML document; TOML has no null, so None is written as the string "none" (a storage_key
    of None is left out: the key refuses "none")."""
    def value(v: object) -> str:
        if v is None:
            return '"none"'
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(v)  # NAME_CHARS need no escapes beyond JSON's, which TOML shares
    return "".join(f"{k} = {value(v)}\n" for k, v in d.items() if not (k == "storage_key" and v is None))


@SETTINGS
@given(configs())
def test_dict_round_trip(cfg):
    assert RuntimeConfig.from_dict(cfg.to_dict()) == cfg
    assert RuntimeConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@SETTINGS
@given(configs(), st.data())
def test_env_round_trip(cfg, data):
    # (a storage_key of None is the variable unset: "none" is refused for the key)
    env = {f"HICACHE_{k.upper()}": as_env_text(v, k, data.draw) for k, v in cfg.to_dict().items()
           if not (k == "storage_key" and v is None)}
    env["UNRELATED"] = "1"
    assert RuntimeConfig.from_env(env) == cfg
    # a subset of variables over a base: the rest comes from the base
    keep = data.draw(st.sets(st.sampled_from(sorted(env))))
    assert RuntimeConfig.from_env({k: env[k] for k in keep}, base=cfg) == cfg


@SETTINGS
@given(configs(), st.sampled_from([".json", ".toml"]))
def test_file_round_trip(tmp_path_factory, cfg, suffix):
    path = tmp_path_factory.mktemp("cfg") / f"hicache{suffix}"
    d = cfg.to_dict()
    path.write_text(json.dumps(d) if suffix == ".json" else toml_text(d))
    assert RuntimeConfig.from_file(path) == cfg


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**62), st.sampled_from(sorted(SIZE_UNITS)), st.data())
def test_size_strings_round_trip_in_every_unit(nbytes, unit, data):
    assert parse_size(size_text(nbytes, unit, lambda *o: data.draw(st.sampled_from(o)))) == nbytes


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**7), st.integers(0, 6), st.sampled_from(sorted(SIZE_UNITS)))
def test_size_strings_denote_exact_bytes(numerator, digits, unit):
    """'<decimal><unit>' is exactly decimal * scale bytes when that is whole; refused otherwise."""
    x = Fraction(numerator, 10**digits)
    text = exact_decimal(x) + unit
    exact = x * SIZE_UNITS[unit]
    if exact.denominator == 1:
        assert parse_size(text) == exact
    else:
        with pytest.raises(ConfigError, match="not a whole number of bytes"):
            parse_size(text)


@given(st.integers(1, 2**40), st.sampled_from(["", "B", "GiB", "MB"]))
def test_negative_sizes_are_refused(nbytes, unit):
    with pytest.raises(ConfigError, match="host_bytes must not be negative"):
        parse_size(f"-{nbytes}{unit}", "host_bytes")


# Any text for an int or a float field, from the environment or a dict: read exactly as the plain
# ASCII number it spells (int(), float() of it) or refused with a ConfigError naming the field,
# never read some other way. Checked to be able to fail: with the previous conversion
# (`int(value.strip(), 10)`, `float(value.strip())`) it finds " 0", "0_0", "٠" or "inf" at once.
number_text = st.one_of(
    st.text(st.sampled_from("0123456789-+_. eE٠１infatyINFATY"), max_size=8),
    st.text(max_size=6),
    st.from_regex(r"-?[0-9]{1,25}", fullmatch=True),
)


def plain_int(text: str) -> int | None:
    digits = text.removeprefix("-")
    if digits and len(digits) <= 19 and all("0" <= c <= "9" for c in digits) and -(2**63) <= int(text) < 2**63:
        return int(text)
    return None


@settings(max_examples=400, deadline=None)
@given(number_text)
def test_int_text_is_plain_ascii_digits_or_refused(text):
    want = plain_int(text)
    for read in (lambda: RuntimeConfig.from_env({"HICACHE_PREFETCH_THRESHOLD": text}).prefetch_threshold,
                 lambda: RuntimeConfig.from_dict({"prefetch_threshold": text}).prefetch_threshold):
        if want is not None and want >= 0:
            assert read() == want
        else:  # (a negative one is refused by the range check, naming the field as well)
            with pytest.raises(ConfigError, match="prefetch_threshold"):
                read()


@settings(max_examples=400, deadline=None)
@given(number_text)
def test_float_text_is_a_plain_finite_decimal_or_refused(text):
    import math
    import re

    plain = re.fullmatch(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?", text, re.ASCII)
    want = float(text) if plain and math.isfinite(float(text)) else None
    read = lambda: RuntimeConfig.from_env({"HICACHE_PREFETCH_TIMEOUT_BASE_S": text}).prefetch_timeout_base_s  # noqa: E731
    if want is not None and want >= 0:
        assert read() == want
    else:
        with pytest.raises(ConfigError, match="prefetch_timeout_base_s"):
            read()
