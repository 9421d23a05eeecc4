"""`ConnectorConfig`: every bad option of the vLLM connector is a `ConfigError` naming its key,
raised before anything is created; sizes in bytes or blocks; the default host tier bounded by
the memory available; the default `model_id` independent of where the model lies.

vLLM's config objects are stood in for by namespaces holding the attributes the module reads
(the e2e tests read it through vLLM's real scheduler)."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest

from runtime.errors import ConfigError
from runtime.integrations.vllm.config import ConnectorConfig, model_digest, open_storage, storage_key

LAYERS, PAGE = 2, 4096  # a vLLM block of one layer: 4 KiB
BLOCK_BYTES = LAYERS * PAGE
GiB = 2**30


def vllm(model: str, *, tp: int = 1, pp: int = 1, revision: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(model=model, revision=revision),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))


KV = SimpleNamespace(num_blocks=1000, kv_cache_groups=[SimpleNamespace(
    layer_names=[f"l{i}" for i in range(LAYERS)],
    kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE, num_kv_heads=2, block_size=16, head_size=64,
                                  dtype="torch.float16"))])


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    return str(d)


def read(extra: dict, model: str = "org/name", *, available: int = 64 * GiB, **kw) -> ConnectorConfig:
    return ConnectorConfig.from_vllm(vllm(model, **kw), KV, extra, available=available)  # type: ignore[arg-type]


# -- the bad-config table: each row a ConfigError naming its key -----------------------------------
@pytest.mark.parametrize(("extra", "key"), [
    ({"host_block": 10}, "'host_block' (did you mean 'host_blocks'?)"),  # typo
    ({"storage_dri": "/x"}, "'storage_dri' (did you mean 'storage_dir'?)"),
    ({"host_blocks": "many"}, "host_blocks must be an integer"),  # non-int
    ({"host_blocks": 1.5}, "host_blocks must be an integer"),
    ({"host_blocks": True}, "host_blocks must be an integer"),
    ({"host_blocks": 0}, "host_blocks must be positive"),
    ({"host_blocks": 10**12}, "host_blocks: 1000000000000 blocks"),  # today: MemoryError in numpy
    ({"host_bytes": "63GiB"}, "host_bytes: "),  # beyond 90% of the 64 GiB available
    ({"host_bytes": "lots"}, "host_bytes must be a byte count"),
    ({"host_bytes": "8 GiBs"}, "host_bytes has an unknown unit"),
    ({"host_bytes": 100}, "host_bytes (100 bytes) holds no vLLM block"),
    ({"host_bytes": "1GiB", "host_blocks": 10}, "host_bytes or host_blocks, not both"),
    ({"storage_dir": "kv"}, "storage_dir must be an absolute path"),  # relative: refused
    ({"storage_dir": ""}, "storage_dir must be a directory path"),
    ({"storage_dir": 7}, "storage_dir must be a directory path"),
    ({"storage_backend": "s3"}, "storage_backend must be one of"),
    ({"storage_backend": "file"}, "storage_dir is required"),
    ({"storage_dir": "/tmp", "storage_cap_bytes": "1KiB"}, "storage_cap_bytes must hold at least one page file"),
    ({"storage_dir": "/tmp", "storage_cap_bytes": "-5GB"}, "storage_cap_bytes must not be negative"),
    ({"storage_dir": "/tmp", "storage_cap_bytes": "big"}, "storage_cap_bytes must be a byte count"),
    ({"storage_cap_bytes": "1GiB"}, "storage_cap_bytes needs a storage tier"),
    ({"storage_backend": "mooncake", "storage_dir": "/tmp"}, "storage_dir is a file backend option"),
    ({"storage_dir": "/tmp", "mooncake": {}}, "mooncake is a Mooncake option"),
    ({"storage_backend": "mooncake", "mooncake": {"master_server_adress": "h:1"}},
     "'master_server_adress' (did you mean 'master_server_address'?)"),
    ({"storage_backend": "mooncake", "mooncake": {"master_server_address": "h:1"}}, "mooncake.metadata_server is required"),
    ({"storage_backend": "mooncake", "mooncake": {"master_server_address": "nohost", "metadata_server": "P2PHANDSHAKE"}},
     "mooncake: master_server_address must be 'host:port'"),
    ({"storage_backend": "mooncake", "mooncake": {"master_server_address": "h:1", "metadata_server": "P2PHANDSHAKE",
                                                  "global_segment_size": "4 gigs"}}, "mooncake.global_segment_size"),
    ({"storage_backend": "mooncake", "mooncake": "h:1"}, "mooncake must be a mapping"),
    ({"model_id": 3}, "model_id must be a non-empty string"),
    ({"weight_version": ""}, "weight_version must be a non-empty string"),
])
def test_every_bad_option_is_a_config_error_naming_its_key(extra, key):
    with pytest.raises(ConfigError) as err:
        read(extra)
    assert key in str(err.value)
    assert "kv_connector_extra_config" in str(err.value)


def test_storage_dir_that_is_a_file_is_refused_naming_the_key(tmp_path):
    """Was a bare FileExistsError from os.makedirs at scheduler start."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"storage_dir .* exists and is not a directory"):
        read({"storage_dir": str(f)})
    with pytest.raises(ConfigError, match=r"storage_dir .* cannot be created: .* is not a directory"):
        read({"storage_dir": str(f / "below")})


@pytest.mark.skipif(os.geteuid() == 0, reason="root creates directories anywhere")
def test_uncreatable_storage_dir_is_refused_naming_the_key(tmp_path):
    """Was a bare FileNotFoundError / PermissionError from os.makedirs."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(ConfigError, match=r"storage_dir .* cannot be created: .* is not writable"):
            read({"storage_dir": str(locked / "a" / "b")})
    finally:
        locked.chmod(0o700)


def test_a_directory_the_os_will_not_create_is_a_config_error_naming_the_key():
    """Where the permission check passes (root) and the OS still refuses (a pseudo file system),
    opening the storage names the key. Was a bare FileNotFoundError."""
    with pytest.raises(ConfigError, match="storage_dir '/proc/hicache-test/kv'"):
        open_storage(read({"storage_dir": "/proc/hicache-test/kv"}))


def test_nothing_is_created_by_reading_the_config(tmp_path):
    path = tmp_path / "a" / "b"
    config = read({"storage_dir": str(path), "storage_cap_bytes": "1GiB"})
    assert not path.exists()
    assert (config.storage_backend, config.storage_dir, config.storage_cap_bytes) == ("file", str(path), GiB)
    backend = open_storage(config)
    try:
        assert path.is_dir() and backend.page_bytes == BLOCK_BYTES
    finally:
        backend.close()


def test_a_storage_dir_that_vanished_after_the_check_is_still_a_config_error_naming_the_key(tmp_path):
    config = read({"storage_dir": str(tmp_path / "kv")})
    (tmp_path / "kv").write_text("now a file")
    with pytest.raises(ConfigError, match="storage_dir .*cannot open it"):
        open_storage(config)


def test_storage_under_pipeline_parallelism_is_refused(tmp_path):
    """Pipeline stages hold different layers of one page and there are no per-stage keys yet."""
    with pytest.raises(ConfigError, match="pipeline_parallel_size 1"):
        read({"storage_dir": str(tmp_path / "kv")}, tp=2, pp=2)
    assert list(tmp_path.iterdir()) == []  # refused before the directory was touched


# -- sizing ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "nbytes"), [
    ("64MiB", 64 * 2**20), ("64MB", 64 * 10**6), ("1.5GB", 1_500_000_000), ("8 kib", 8192), (16384, 16384),
    (1e6, 10**6), ("16384", 16384)])
def test_host_bytes_take_binary_and_decimal_units_as_runtime_config_reads_them(size, nbytes):
    config = read({"host_bytes": size})
    assert config.host_blocks == nbytes // BLOCK_BYTES and config.host_bytes <= nbytes < config.host_bytes + BLOCK_BYTES


def test_host_blocks_still_work_and_a_string_of_digits_is_an_int():
    assert read({"host_blocks": 64}).host_blocks == 64
    assert read({"host_blocks": "64"}).host_blocks == 64


def test_host_sizes_are_checked_against_every_workers_share_of_available_memory():
    per_worker = 10 * GiB // BLOCK_BYTES
    assert read({"host_blocks": per_worker}, available=12 * GiB).host_blocks == per_worker
    with pytest.raises(ConfigError, match=r"host_blocks: .* x 2 worker\(s\) exceeds 90%"):
        read({"host_blocks": per_worker}, available=12 * GiB, tp=2)


def test_default_host_tier_is_the_gpu_pool_within_a_quarter_of_available_memory():
    assert read({}).host_blocks == KV.num_blocks  # 8 MB of blocks: the GPU pool's size
    small = 64 * BLOCK_BYTES * 4  # a quarter of it holds 64 blocks
    assert read({}, available=small).host_blocks == 64
    assert read({}, available=small, tp=4).host_blocks == 16  # shared by the workers
    assert read({}, available=0).host_blocks == 1


# -- identity --------------------------------------------------------------------------------------
def test_default_model_id_is_the_model_directorys_content_not_its_path(tmp_path, model):
    (tmp_path / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    copy = shutil.copytree(model, tmp_path / "elsewhere" / "copy")
    a, b = read({}, model), read({}, str(copy))
    assert a.identity == b.identity and a.identity.model_id.startswith("sha256:")
    # other weights (one byte in a sampled chunk) or another config: another identity
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert model_digest(str(copy)) != a.identity.model_id
    (copy / "model.safetensors").write_bytes((tmp_path / "model" / "model.safetensors").read_bytes())
    assert model_digest(str(copy)) == a.identity.model_id
    (copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 128}')
    assert model_digest(str(copy)) != a.identity.model_id


def test_a_hub_name_is_its_own_model_id_with_vllms_revision_and_options_override_both(model):
    config = read({}, "org/name", revision="abc123")
    assert (config.identity.model_id, config.identity.weight_version) == ("org/name", "abc123")
    config = read({"model_id": "mine", "weight_version": "v2"}, model)
    assert (config.identity.model_id, config.identity.weight_version) == ("mine", "v2")
    assert read({}, model, tp=2).identity.shard == "tp0of2"


def test_mooncake_options_sizes_as_runtime_config_reads_them_and_the_scheduler_lends_no_memory():
    config = read({"storage_backend": "mooncake", "mooncake": {
        "master_server_address": "127.0.0.1:1", "metadata_server": "P2PHANDSHAKE", "global_segment_size": "1GB",
        "local_buffer_size": "16MiB", "key_prefix": "kv/"}})
    mc = config.mooncake
    assert mc is not None and (mc.global_segment_size, mc.local_buffer_size) == (10**9, 16 * 2**20)
    assert config.storage_where == "mooncake:127.0.0.1:1/kv/"


def test_mooncake_options_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:5")
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    assert read({"storage_backend": "mooncake"}).mooncake.master_server_address == "127.0.0.1:5"
    monkeypatch.delenv("MOONCAKE_MASTER")
    with pytest.raises(ConfigError, match="mooncake: not given, and from the environment"):
        read({"storage_backend": "mooncake"})


# -- the page-tag key --------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["none", "NULL", " none ", "", "   ", "short"])
def test_a_storage_key_variable_that_holds_no_key_is_refused_naming_it(value):
    """The workers read HICACHE_STORAGE_KEY as RuntimeConfig.from_env does: "none" is not unkeyed
    (was a ConfigError not naming the variable; a blank key of 16 bytes was taken as a key)."""
    with pytest.raises(ConfigError) as err:
        storage_key({"HICACHE_STORAGE_KEY": value})
    msg = str(err.value)
    assert "HICACHE_STORAGE_KEY" in msg and (value.strip() == "" or value.strip().lower() not in msg.lower())
    assert storage_key({}) is None and storage_key({"HICACHE_STORAGE_KEY": "k" * 16}) == "k" * 16
