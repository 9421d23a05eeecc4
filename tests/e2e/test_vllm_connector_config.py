"""The connector's options read through vLLM 0.33's real scheduler (`runtime.integrations.vllm.config`):
a bad option fails the scheduler's start with a `ConfigError` naming its key, sizes in bytes,
and a model loaded from two paths shares its stored pages."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by scripts/install_vllm.sh")

from runtime.errors import ConfigError  # noqa: E402
from tests.e2e.vllm_engine import BLOCK, FakeEngine, save_tiny_model, vllm_config  # noqa: E402

PROMPT = list(range(100, 100 + 3 * BLOCK)) + [7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(str(path))
    return str(path)


def engine(model_dir: str, extra: dict, blocks: int = 32) -> FakeEngine:
    return FakeEngine(vllm_config(model_dir, connector="HiCacheConnector", extra=extra), blocks)


@pytest.mark.parametrize(("extra", "key"), [
    ({"host_blocks": 10**12}, "host_blocks: 1000000000000 blocks"),  # was a MemoryError in numpy
    ({"host_bytes": "1000PB"}, "host_bytes: "),
    ({"hostblocks": 8}, "did you mean 'host_blocks'"),
    ({"storage_dir": "relative/kv"}, "storage_dir must be an absolute path"),
])
def test_a_bad_option_fails_the_schedulers_start_naming_its_key(model_dir, extra, key):
    with pytest.raises(ConfigError, match=key):
        engine(model_dir, extra)


def test_host_bytes_size_the_host_tier_in_both_roles(model_dir):
    e = engine(model_dir, {"host_bytes": "1MiB"})
    config = e.scheduler.connector.config  # (the facade vLLM loaded; e.connector is its scheduler side)
    assert config.host_blocks == e.worker.host_blocks == (1 << 20) // config.block_bytes
    assert e.worker.copier.host.numel() * e.worker.copier.host.element_size() == config.host_bytes


def test_one_model_loaded_from_two_paths_shares_its_stored_pages(model_dir, tmp_path, monkeypatch, capsys):
    """Instance A (the model at one path) writes its pages; B, the same model copied elsewhere,
    loads them from storage. Checked failing with the default model_id set to vLLM's `--model`
    (the path): B loaded nothing."""
    shared = str(tmp_path / "kv")
    copy = str(shutil.copytree(model_dir, tmp_path / "elsewhere"))
    a = engine(model_dir, {"host_blocks": 64, "storage_dir": shared})
    a.add("a", PROMPT, 2)
    a.run()
    a.assert_drained()
    assert a.connector.core.storage.stats["storage_pages_written"] > 0
    from vllm.logger import _configure_vllm_root_logger

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")
    _configure_vllm_root_logger()  # (as vLLM does at import, from the environment)
    try:
        capsys.readouterr()
        b = engine(copy, {"host_blocks": 64, "storage_dir": shared})
        out = capsys.readouterr().out
    finally:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
        _configure_vllm_root_logger()
    assert b.connector.identity == a.connector.identity
    # one line at start (the scheduler's, not each worker's), in vLLM's log, names the identity
    # and the directory
    started = [line for line in out.splitlines() if "HiCache connector started" in line]
    assert len(started) == 1, out
    assert f"storage file:{shared}," in started[0] and f"model_id {a.connector.identity.model_id}," in started[0]
    assert copy not in started[0]
    b.add("b", PROMPT, 2)
    b.run()
    assert b.connector.core.stats["tokens_storage_loaded"] == 3 * BLOCK
    assert b.outputs["b"] == a.outputs["a"]
    b.assert_drained()
