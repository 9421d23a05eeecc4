"""RuntimeConfig from a dict, the environment and JSON / TOML files: conversions, sizes, errors
naming the field, round trips (the randomized round trips: tests/property/test_config_props.py)."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest

from runtime.assembly import check_machine, host_pool_bytes
from runtime.config import RuntimeConfig
from runtime.config_sources import parse_size
from runtime.errors import ConfigError, ValidationError
from runtime.runtime import CacheRuntime

GiB = 2**30


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# -- sizes ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, nbytes", [
    ("4096", 4096), ("0", 0), ("8GiB", 8 * GiB), ("8gib", 8 * GiB), ("512MiB", 512 * 2**20),
    ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1.1GB", 1_100_000_000),
    ("1.5GiB", 3 * 2**29), ("4gb", 4 * 10**9), ("2TB", 2 * 10**12), ("1PiB", 2**50), ("10B", 10),
    (".5KiB", 512), ("3.KB", 3000), (4096, 4096), (8e9, 8 * 10**9),
])
def test_parse_size_accepts_bytes_and_units(text, nbytes):
    assert parse_size(text, "host_bytes") == nbytes


@pytest.mark.parametrize("text, says", [
    ("-1GB", "negative"), (-5, "negative"), ("8XB", "unknown unit 'XB'"), ("8G", "unknown unit 'G'"),
    ("0.5B", "not a whole number of bytes"), ("1.0000000001KiB", "not a whole number"), (1.5, "whole"),
    ("", "size such as"), ("GiB", "size such as"), ("1e9", "size such as"), (True, "byte count"),
    (float("inf"), "whole"), (float("nan"), "whole"), ([1], "byte count"),
    (" 1KiB ", "size such as"), ("1_024", "size such as"), ("１０２４", "size such as"), ("8  GiB", "size such as"),
    ("9" * 5001, "too long"),
])
def test_parse_size_refuses_with_the_field_named(text, says):
    msg = error(parse_size, text, "storage_cap_bytes")
    assert msg.startswith("storage_cap_bytes") and says in msg


# -- from_dict --------------------------------------------------------------------------

def test_from_dict_converts_by_field_type():
    cfg = RuntimeConfig.from_dict({
        "page_size": "8", "device_slots": 512, "host_ratio": "3", "host_bytes": "1GiB",
        "decode_offload": True, "debug_invariants": False, "offload_stride": "NONE", "vocab_size": "null",
        "prefetch_timeout_base_s": "0.5", "storage_timeout_s": 7, "kv_dtype": "bfloat16",
    })
    assert (cfg.page_size, cfg.device_slots, cfg.host_ratio, cfg.host_bytes) == (8, 512, 3.0, GiB)
    assert cfg.decode_offload is True and cfg.debug_invariants is False
    assert cfg.offload_stride is None and cfg.vocab_size is None
    assert cfg.prefetch_timeout_base_s == 0.5 and type(cfg.storage_timeout_s) is float
    assert cfg.kv_dtype == "bfloat16"
    assert RuntimeConfig.from_dict({}) == RuntimeConfig()


@pytest.mark.parametrize("data, says", [
    ({"page_sise": 4}, "unknown config field 'page_sise' (did you mean 'page_size'?)"),
    ({"zzz": 1}, "unknown config field 'zzz'"),
    ({1: 1}, "unknown config field 1"),
    ({"page_size": "sixteen"}, "page_size must be an integer, got 'sixteen'"),
    ({"page_size": 16.0}, "page_size must be an integer, got 16.0"),
    ({"page_size": True}, "page_size must be an integer, got True"),
    ({"page_size": None}, "page_size may not be null"),
    ({"page_size": "none"}, "page_size must be an integer, got 'none'"),
    ({"host_ratio": "lots"}, "host_ratio must be a number, got 'lots'"),
    ({"host_ratio": False}, "host_ratio must be a number, got False"),
    ({"decode_offload": "maybe"}, "decode_offload must be a bool"),
    ({"decode_offload": 1}, "decode_offload must be a bool"),
    ({"model_id": 7}, "model_id must be a string, got 7"),
    ({"host_bytes": "8 parsecs"}, "host_bytes has an unknown unit 'parsecs'"),
    ({"host_bytes": "-8GiB"}, "host_bytes must not be negative"),
    ({"storage_cap_bytes": "0.1B"}, "storage_cap_bytes is not a whole number of bytes"),
    ({"storage": {"dir": "/x"}}, "'storage' is a nested table"),
    ({"page_size": 3}, "page_size must be a power of two"),  # __post_init__ still validates
    ({"storage_cap_bytes": "0"}, "storage_cap_bytes must be a positive int"),
])
def test_from_dict_errors_name_the_field(data, says):
    assert says in error(RuntimeConfig.from_dict, data)


def test_from_dict_refuses_a_non_mapping():
    assert "mapping" in error(RuntimeConfig.from_dict, [("page_size", 4)])


def test_config_error_is_a_validation_error():
    assert issubclass(ConfigError, ValidationError)


def test_sizes_are_parsed_by_the_sources_only():
    """The dataclass keeps typed ints: a size string given to the constructor is refused."""
    assert "host_bytes" in error(RuntimeConfig, host_bytes="8GiB")
    assert RuntimeConfig.from_dict({"host_bytes": "8GiB"}).host_bytes == 8 * GiB


def test_to_dict_round_trip_of_a_non_default_config():
    cfg = RuntimeConfig(page_size=32, device_slots=1024, host_bytes=3 * GiB, host_layout="page_first",
                        write_policy="write_back", eviction_policy="lfu", decode_offload=True,
                        offload_stride=64, storage_backend="file", storage_dir="kv-store",
                        storage_cap_bytes=10**9, prefetch_policy="best_effort", vocab_size=32000,
                        kv_layout="mla", num_kv_heads=1, head_dim=576)
    d = cfg.to_dict()
    assert d["host_bytes"] == 3 * GiB and d["storage_dir"] == "kv-store" and d["trace_path"] is None
    assert RuntimeConfig.from_dict(d) == cfg
    assert RuntimeConfig.from_dict(json.loads(json.dumps(d))) == cfg


# -- from_env ---------------------------------------------------------------------------

def test_from_env_reads_prefixed_variables_only():
    env = {"HICACHE_PAGE_SIZE": "32", "HICACHE_DEVICE_SLOTS": "2048", "HICACHE_HOST_BYTES": "64MiB",
           "HICACHE_DEBUG_INVARIANTS": "true", "HICACHE_TRACE_PATH": "none", "PATH": "/bin", "SGLANG_X": "1"}
    cfg = RuntimeConfig.from_env(env)
    assert (cfg.page_size, cfg.device_slots, cfg.host_bytes, cfg.debug_invariants) == (32, 2048, 64 * 2**20, True)
    assert cfg.trace_path is None
    assert RuntimeConfig.from_env({"MY_PAGE_SIZE": "4"}, prefix="MY_").page_size == 4
    assert RuntimeConfig.from_env({}) == RuntimeConfig()


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("HICACHE_MAX_INFLIGHT_LOADS", "7")
    assert RuntimeConfig.from_env().max_inflight_loads == 7


def test_from_env_overrides_a_base_config_or_dict():
    base = RuntimeConfig(page_size=8, device_slots=256, model_id="m")
    cfg = RuntimeConfig.from_env({"HICACHE_PAGE_SIZE": "16"}, base=base)
    assert (cfg.page_size, cfg.device_slots, cfg.model_id) == (16, 256, "m")
    cfg = RuntimeConfig.from_env({"HICACHE_MODEL_ID": "llama"}, base={"model_id": "m", "host_bytes": "1GiB"})
    assert (cfg.model_id, cfg.host_bytes) == ("llama", GiB)
    assert "page_sise" in error(RuntimeConfig.from_env, {}, base={"page_sise": 4})
    assert "base must be" in error(RuntimeConfig.from_env, {}, base=[1])


@pytest.mark.parametrize("env, says", [
    ({"HICACHE_PAGE_SIZ": "16"}, "environment variable HICACHE_PAGE_SIZ names no config field "
                                 "(did you mean 'HICACHE_PAGE_SIZE'?)"),
    ({"HICACHE_": "1"}, "environment variable HICACHE_ names no config field"),
    ({"HICACHE_PAGE_SIZE": "x"}, "page_size (from HICACHE_PAGE_SIZE='x') must be an integer"),
    ({"HICACHE_HOST_BYTES": "8GB!"}, "host_bytes (from HICACHE_HOST_BYTES='8GB!')"),
    ({"HICACHE_DECODE_OFFLOAD": "2"}, "decode_offload (from HICACHE_DECODE_OFFLOAD='2') must be a bool"),
    ({"HICACHE_PAGE_SIZE": "none"}, "page_size (from HICACHE_PAGE_SIZE='none') must be an integer"),
    ({"HICACHE_PAGE_SIZE": "12"}, "page_size must be a power of two"),
])
def test_from_env_errors_name_the_variable(env, says):
    assert says in error(RuntimeConfig.from_env, env)


def test_from_env_refuses_an_empty_prefix():
    assert "prefix" in error(RuntimeConfig.from_env, {}, prefix="")


# -- from_file --------------------------------------------------------------------------

def test_from_file_json_and_toml(tmp_path):
    toml = tmp_path / "hicache.toml"
    toml.write_text('page_size = 32\ndevice_slots = 4096\nhost_bytes = "2GiB"\nstorage_backend = "file"\n'
                    'storage_dir = "/data/kv"\nstorage_cap_bytes = "500GB"\nprefetch_policy = "wait_complete"\n'
                    'debug_invariants = true\nprefetch_timeout_max_s = 10.0\n')
    cfg = RuntimeConfig.from_file(toml)
    assert (cfg.page_size, cfg.host_bytes, cfg.storage_cap_bytes) == (32, 2 * GiB, 500 * 10**9)
    assert (cfg.storage_backend, cfg.storage_dir, cfg.debug_invariants) == ("file", "/data/kv", True)
    js = tmp_path / "hicache.JSON"  # suffix in any case
    js.write_text(json.dumps(cfg.to_dict()))
    assert RuntimeConfig.from_file(str(js)) == cfg


@pytest.mark.parametrize("name, text, says", [
    ("c.yaml", "page_size: 4", "must end in .json or .toml, not '.yaml'"),
    ("config", "{}", "must end in .json or .toml, not 'no suffix'"),
    ("c.toml", "page_size = ", "is not valid TOML"),
    ("c.json", "{page_size: 4}", "is not valid JSON"),
    ("c.json", "[1, 2]", "must be a mapping"),
    ("c.json", '{"page_size": 4, "page_size": 8}', "'page_size' is given twice"),
    ("c.toml", "[storage]\ndir = '/x'\n", "'storage' (in c.toml) is a nested table"),
    ("c.toml", "page_sise = 4\n", "unknown config field 'page_sise' (in c.toml) (did you mean 'page_size'?)"),
    ("c.toml", "host_bytes = '8 GB?'\n", "host_bytes (in c.toml)"),
    ("c.toml", "page_size = 12\n", "page_size must be a power of two in 1..256, got 12 (in c.toml)"),
])
def test_from_file_errors(tmp_path, name, text, says):
    path = tmp_path / name
    path.write_text(text)
    assert says in error(RuntimeConfig.from_file, path)


def test_from_file_missing_or_unreadable(tmp_path):
    assert re.search(r"cannot read config file .*nope\.toml", error(RuntimeConfig.from_file, tmp_path / "nope.toml"))
    bad = tmp_path / "latin.json"
    bad.write_bytes(b'{"model_id": "\xe9"}')
    assert "not valid JSON" in error(RuntimeConfig.from_file, bad)


def test_file_then_env_layering(tmp_path):
    """The deployment pattern: a file for the fleet, the environment for one instance."""
    path = tmp_path / "fleet.toml"
    path.write_text('page_size = 16\nhost_bytes = "8GiB"\nmodel_id = "llama-3-8b"\n')
    cfg = RuntimeConfig.from_env({"HICACHE_HOST_BYTES": "4GiB"}, base=RuntimeConfig.from_file(path))
    assert (cfg.page_size, cfg.host_bytes, cfg.model_id) == (16, 4 * GiB, "llama-3-8b")


# -- tensor parallelism -----------------------------------------------------------------

@pytest.mark.parametrize("changes, says", [
    (dict(tp_size=0), "tp_size must be a positive integer, got 0"),
    (dict(tp_size=True), "tp_size must be an integer, got True"),
    (dict(tp_rank=2, tp_size=2), "tp_rank must be an int in [0, tp_size) = [0, 2), got 2"),
    (dict(tp_rank=-1, tp_size=2), "tp_rank must be an int in [0, tp_size) = [0, 2), got -1"),
    (dict(tp_rank=1), "tp_rank must be an int in [0, tp_size) = [0, 1), got 1"),
    (dict(tp_rank=1.0, tp_size=2), "tp_rank must be an int"),
])
def test_tp_rank_and_size_are_validated(changes, says):
    assert says in error(RuntimeConfig, **changes)


@pytest.mark.parametrize("changes, says", [
    (dict(tp_ranks=0), "tp_ranks must be a positive integer, got 0"),
    (dict(tp_ranks=True), "tp_ranks must be an integer, got True"),
    (dict(tp_ranks=2.0, tp_size=2), "tp_ranks must be an integer, got 2.0"),
    (dict(tp_ranks=2), "tp_ranks 2: one control plane drives every rank of the instance, so tp_size must equal it"),
    (dict(tp_ranks=2, tp_size=4), "tp_size must equal it and tp_rank be 0 (got tp_size 4, tp_rank 0)"),
    (dict(tp_ranks=2, tp_size=2, tp_rank=1), "(got tp_size 2, tp_rank 1)"),
    (dict(tp_ranks=2, tp_size=2, state_layers=1, state_components="conv:4x2:float32", state_slots=4),
     "recurrent state (state_layers > 0) has no per-rank pools (tp_ranks > 1) yet"),
    (dict(tp_ranks=2, tp_size=2, num_layers=2, sliding_layers="0", sliding_window=8),
     "sliding_layers has no per-rank pools (tp_ranks > 1) yet"),
])
def test_tp_ranks_is_validated(changes, says):
    assert says in error(RuntimeConfig, **changes)


def test_tp_ranks_of_one_control_plane():
    cfg = RuntimeConfig.from_env({"HICACHE_TP_RANKS": "4", "HICACHE_TP_SIZE": "4"})
    assert (cfg.tp_ranks, cfg.tp_size, cfg.tp_rank) == (4, 4, 0)
    assert RuntimeConfig().tp_ranks == 1


def test_tp_fields_from_env():
    cfg = RuntimeConfig.from_env({"HICACHE_TP_RANK": "3", "HICACHE_TP_SIZE": "4"})
    assert (cfg.tp_rank, cfg.tp_size) == (3, 4)
    assert "tp_rank" in error(RuntimeConfig.from_env, {"HICACHE_TP_RANK": "4", "HICACHE_TP_SIZE": "4"})


# -- KV dtypes --------------------------------------------------------------------------

@pytest.mark.parametrize("name, itemsize", [("float32", 4), ("float16", 2), ("bfloat16", 2),
                                            ("float8_e4m3fn", 1), ("float8_e5m2", 1)])
def test_kv_dtype_sets_the_torch_dtype_and_bytes_per_token(name, itemsize):
    cfg = RuntimeConfig(num_layers=3, num_kv_heads=2, head_dim=8, kv_dtype=name, host_bytes=1 << 20)
    assert str(cfg.torch_dtype) == f"torch.{name}"
    assert cfg.bytes_per_token == 2 * 3 * 2 * 8 * itemsize
    assert cfg.host_slots == (1 << 20) // cfg.bytes_per_token // cfg.page_size * cfg.page_size
    assert RuntimeConfig.from_env({"HICACHE_KV_DTYPE": name}).kv_dtype == name


def test_kv_dtype_unknown_is_refused_naming_the_field():
    for bad in ("float8", "fp8", "float64", "int8"):
        assert error(RuntimeConfig, kv_dtype=bad).startswith("kv_dtype must be one of")


# -- KV layout (MLA) -----------------------------------------------------------------------

def test_kv_layout_mla_has_one_part_per_token():
    mha = RuntimeConfig(num_layers=3, num_kv_heads=1, head_dim=8, kv_dtype="bfloat16")
    mla = mha.replace(kv_layout="mla")
    assert (mha.kv_parts, mla.kv_parts) == (2, 1)
    assert mla.bytes_per_token == 3 * 8 * 2 and mha.bytes_per_token == 2 * mla.bytes_per_token
    assert mla.replace(host_tokens=None, host_bytes=1 << 20).host_slots == (1 << 20) // 48 // 16 * 16


def test_kv_layout_from_sources(tmp_path):
    assert RuntimeConfig.from_env({"HICACHE_KV_LAYOUT": "mla", "HICACHE_NUM_KV_HEADS": "1"}).kv_layout == "mla"
    assert RuntimeConfig.from_dict({"kv_layout": "mla", "num_kv_heads": 1, "head_dim": 576}).head_dim == 576
    path = tmp_path / "mla.toml"
    path.write_text('kv_layout = "mla"\nnum_kv_heads = 1\nhead_dim = 576\n')
    cfg = RuntimeConfig.from_file(path)
    assert (cfg.kv_layout, cfg.head_dim) == ("mla", 576) and RuntimeConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("changes, says", [
    (dict(kv_layout="MLA"), "kv_layout must be one of ['mha', 'mla'], got 'MLA'"),
    (dict(kv_layout=None), "kv_layout must be a string, got None"),
    (dict(kv_layout="mla", num_kv_heads=2), "kv_layout 'mla' keeps one latent per token: num_kv_heads must be 1"),
])
def test_kv_layout_is_validated_naming_the_field(changes, says):
    assert says in error(RuntimeConfig, **changes)


# -- strict values: every way in refuses the same text -----------------------------------
# Each was accepted before this table existed ("1_6", "１６", " 16 " read as 16; host_ratio "inf"
# and JSON Infinity accepted, then an OverflowError at open; a 5,001-digit JSON integer an
# untyped ValueError; decode_offload "yes" accepted by RuntimeConfig): checked failing against
# the previous runtime/config_sources.py and runtime/config.py (41 cases fail there; the rows that
# pass there, "16.0", "0x10", "1e1" and 5,001 digits as text, "0x1p1", were refused before too).

BAD_INTS = ["1_6", "１６", " 16 ", "16 ", "+16", "16.0", "0x10", "1e1", "٣", "9" * 20, "9" * 5001]
BAD_FLOATS = ["inf", "-inf", "nan", "Infinity", "NaN", "1e400", " 2.5", "2_5.0", "２.５", "0x1p1"]


@pytest.mark.parametrize("text", BAD_INTS)
def test_an_int_from_text_is_ascii_digits_only(text, tmp_path):
    assert "page_size (from HICACHE_PAGE_SIZE" in error(RuntimeConfig.from_env, {"HICACHE_PAGE_SIZE": text})
    assert error(RuntimeConfig.from_dict, {"page_size": text}).startswith("page_size must be an integer")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"page_size": text}), encoding="utf-8")
    assert error(RuntimeConfig.from_file, path).startswith("page_size (in c.json) must be an integer")


@pytest.mark.parametrize("text", BAD_FLOATS)
def test_a_float_from_text_is_finite_and_plain(text, tmp_path):
    assert "host_ratio (from HICACHE_HOST_RATIO" in error(RuntimeConfig.from_env, {"HICACHE_HOST_RATIO": text})
    assert error(RuntimeConfig.from_dict, {"host_ratio": text}).startswith("host_ratio must be a number")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_float_field_is_finite_in_code_and_in_files(value, tmp_path):
    assert error(RuntimeConfig, host_ratio=value).startswith("host_ratio must be a number")
    assert error(RuntimeConfig.from_dict, {"host_ratio": value}).startswith("host_ratio must be a number")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"host_ratio": value}))  # JSON's Infinity / -Infinity / NaN
    assert error(RuntimeConfig.from_file, path).startswith("host_ratio (in c.json) must be a number")
    toml = tmp_path / "c.toml"
    toml.write_text(f"host_ratio = {'nan' if value != value else ('inf' if value > 0 else '-inf')}\n")
    assert error(RuntimeConfig.from_file, toml).startswith("host_ratio (in c.toml) must be a number")


def test_integers_are_bounded_everywhere(tmp_path):
    huge = "9" * 5001
    path = tmp_path / "c.json"
    path.write_text('{"page_size": %s}' % huge)
    msg = error(RuntimeConfig.from_file, path)
    assert msg.startswith("page_size (in c.json) must be an integer") and "5001 digits" in msg
    path.write_text('{"host_bytes": %s}' % huge)  # a byte field too
    assert error(RuntimeConfig.from_file, path).startswith("host_bytes")
    path.write_text('{"model_id": %s}' % huge)  # (a string field is not given the digits as text)
    assert error(RuntimeConfig.from_file, path).startswith("model_id (in c.json) must be a string")
    for value in (2**63, -(2**63) - 1, 10**5000):
        assert error(RuntimeConfig, device_slots=value).startswith("device_slots must be an integer")
        assert error(RuntimeConfig.from_dict, {"device_slots": value}).startswith("device_slots must be an integer")
    path.write_text('{"host_ratio": %s}' % huge)  # an int for a float field, too long to be a number
    assert error(RuntimeConfig.from_file, path).startswith("host_ratio (in c.json) must be a number")


@pytest.mark.parametrize("value", ["yes", "true", "1", "on", 1, 0, None, 1.0])
def test_a_bool_field_takes_only_a_bool_outside_the_environment(value, tmp_path):
    # (1 and 0 were already refused by from_dict; every value was accepted or let through by RuntimeConfig)
    assert error(RuntimeConfig, decode_offload=value).startswith("decode_offload must be a bool")
    assert error(RuntimeConfig.from_dict, {"decode_offload": value}).startswith("decode_offload")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"decode_offload": value}))
    assert error(RuntimeConfig.from_file, path).startswith("decode_offload (in c.json)")


@pytest.mark.parametrize("text, want", [("true", True), ("TRUE", True), ("yes", True), ("on", True), ("1", True),
                                        ("false", False), ("No", False), ("off", False), ("0", False)])
def test_the_environment_takes_the_documented_bool_strings(text, want):
    assert RuntimeConfig.from_env({"HICACHE_DECODE_OFFLOAD": text}).decode_offload is want


@pytest.mark.parametrize("text", [" true", "true ", "y", "t", "2", "yes please", ""])
def test_the_environment_refuses_other_bool_strings(text):
    assert "decode_offload (from HICACHE_DECODE_OFFLOAD" in error(RuntimeConfig.from_env, {"HICACHE_DECODE_OFFLOAD": text})


def test_the_storage_key_is_never_in_an_error():
    secret = "s3cr3t-but-short"[:10]
    for msg in (error(RuntimeConfig, storage_key=secret), error(RuntimeConfig.from_env, {"HICACHE_STORAGE_KEY": secret}),
                error(RuntimeConfig, storage_key=b"bytes-key-of-16-bytes")):
        assert secret not in msg and "bytes-key" not in msg and "storage_key" in msg
    assert RuntimeConfig.from_env({"HICACHE_STORAGE_KEY": "k" * 16}).storage_key == "k" * 16


@pytest.mark.parametrize("value", ["none", "NULL", " none ", "Null", "", "   "])
def test_a_storage_key_variable_that_holds_no_key_is_refused_naming_it(value):
    # "none"/"null" mean None for other optional fields; for the key that would quietly turn the MAC off
    msg = error(RuntimeConfig.from_env, {"HICACHE_STORAGE_KEY": value})
    assert "HICACHE_STORAGE_KEY" in msg and "holds no key" in msg
    assert value.strip() == "" or value.strip().lower() not in msg.lower()
    assert RuntimeConfig.from_env({}).storage_key is None  # unset: unkeyed


@pytest.mark.parametrize("value", ["none", "NULL", " none ", "", " " * 20, "null" + " " * 16])
def test_a_storage_key_in_code_or_a_file_that_holds_no_key_is_refused(value, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"storage_key": value}))
    for msg in (error(RuntimeConfig, storage_key=value), error(RuntimeConfig.from_dict, {"storage_key": value}),
                error(RuntimeConfig.from_file, path)):
        assert "storage_key" in msg and "holds no key" in msg
        assert value.strip() == "" or value.strip().lower() not in msg.lower()
    assert RuntimeConfig.from_dict({"storage_key": None}).storage_key is None
    assert "at least 16 bytes" in error(RuntimeConfig, storage_key="k" * 15)  # too short: still refused


# -- checked at open, before anything is built (runtime.assembly.check_machine) ----------------
SMALL = {"device_slots": 256, "page_size": 4}


async def open_error(config: RuntimeConfig) -> str:
    """The ConfigError of opening `config`; no thread was left started (actors, copy threads, a
    metrics server)."""
    before = set(threading.enumerate())
    with pytest.raises(ConfigError) as info:
        async with CacheRuntime.open(config):
            pass
    assert set(threading.enumerate()) <= before
    return str(info.value)


@pytest.mark.parametrize("field, value", [("host_ratio", 1e7), ("host_tokens", 2**40), ("host_bytes", 2**52)])
async def test_a_host_pool_larger_than_memory_is_refused_at_open_naming_its_sizing_field(field, value):
    """Was torch's allocator's RuntimeError (or the kernel's OOM kill) partway through the pools."""
    config = RuntimeConfig(**SMALL, **{field: value}, metrics_port=0)
    msg = await open_error(config)
    assert msg.startswith(f"{field}=") and f"take {host_pool_bytes(config)} bytes" in msg
    assert re.search(r"of the \d+ bytes \([0-9.]+ GiB\) of memory available", msg)


def test_the_host_pools_may_take_90_percent_of_the_memory_available():
    config = RuntimeConfig(**SMALL, host_tokens=1024)
    assert host_pool_bytes(config) == 1024 * config.bytes_per_token
    check_machine(config, available=2 * host_pool_bytes(config))
    assert "host_tokens=1024" in error(check_machine, config, available=host_pool_bytes(config))


async def test_a_storage_dir_that_is_a_file_or_under_one_is_refused_at_open(tmp_path):
    """Was a bare FileExistsError / NotADirectoryError from the file backend's makedirs."""
    f = tmp_path / "file"
    f.write_text("x")
    for path, says in ((f, "exists and is not a directory"),
                       (f / "kv", f"cannot be created: {str(f)!r} is not a directory")):
        msg = await open_error(RuntimeConfig(**SMALL, storage_backend="file", storage_dir=str(path)))
        assert msg == f"storage_dir {str(path)!r} {says}"
    assert f.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only directories")
async def test_a_storage_dir_or_trace_path_in_a_read_only_directory_is_refused_at_open(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        msg = await open_error(RuntimeConfig(**SMALL, storage_backend="file", storage_dir=str(locked / "kv")))
        assert msg.startswith("storage_dir") and "is not writable" in msg
        msg = await open_error(RuntimeConfig(**SMALL, trace_path=str(locked / "trace.jsonl")))
        assert msg.startswith("trace_path") and "is not writable" in msg
    finally:
        locked.chmod(0o700)
    assert list(locked.iterdir()) == []


async def test_a_storage_dir_the_os_will_not_create_is_refused_at_open():
    """Where the permission check passes (root) and the OS still refuses (a pseudo file system)."""
    msg = await open_error(RuntimeConfig(**SMALL, storage_backend="file", storage_dir="/proc/hicache-test/kv"))
    assert msg.startswith("storage_dir '/proc/hicache-test/kv'")


async def test_a_trace_path_that_cannot_be_written_is_refused_at_open(tmp_path):
    """Was a bare FileNotFoundError / IsADirectoryError, after the pools were allocated."""
    store = tmp_path / "kv"
    for path, says in ((tmp_path / "missing" / "t.jsonl", "does not exist"), (tmp_path, "is a directory")):
        msg = await open_error(RuntimeConfig(**SMALL, trace_path=str(path), storage_backend="file",
                                             storage_dir=str(store), metrics_port=0))
        assert msg.startswith(f"trace_path {str(path)!r}") and says in msg
    assert not store.exists()  # checked before the storage directory was made


async def test_a_failed_open_closes_the_trace_file_and_storage_it_opened(tmp_path):
    """A refusal after the trace file and the file backend were opened (here the events endpoint's
    bind) closes them: each failed open used to leave two file descriptors behind."""
    zmq = pytest.importorskip("zmq")
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        config = RuntimeConfig(**SMALL, storage_backend="file", storage_dir=str(tmp_path / "kv"),
                               trace_path=str(tmp_path / "t.jsonl"), kv_events=True,
                               kv_events_endpoint=f"tcp://127.0.0.1:{port}")
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(2):
            assert "kv_events_endpoint" in await open_error(config)
        assert len(os.listdir("/proc/self/fd")) == fds
