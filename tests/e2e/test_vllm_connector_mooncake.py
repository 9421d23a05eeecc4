"""The connector over Mooncake (``storage_backend: "mooncake"``) under vLLM 0.33's real scheduler,
against a local Mooncake cluster (master + metadata server on 127.0.0.1, started by the storage
tests' fixture).

Mooncake clients listen on every interface, so the Mooncake tests run in a private network
namespace holding only loopback: the launcher test below re-runs this file there, as the
backend's own tests do (tests/unit/storage/test_mooncake_backend.py). Skipped only when Mooncake
is not installed (scripts/install_mooncake.sh).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by scripts/install_vllm.sh")
pytest.importorskip("mooncake.store", reason="Mooncake is installed by scripts/install_mooncake.sh")

from runtime.storage.mooncake_backend import MooncakeBackend  # noqa: E402
from runtime.storage.mooncake_cluster import find_binary  # noqa: E402
from tests.e2e.vllm_engine import BLOCK, FakeEngine, save_tiny_model, vllm_config  # noqa: E402
from tests.unit.storage.conftest import mooncake_cluster, netns_run  # noqa: E402,F401 - the fixtures

IN_NETNS = os.environ.get("HICACHE_TEST_NETNS") == "1" or os.environ.get("HICACHE_MOONCAKE_HOST_NETNS") == "1"
REPO = Path(__file__).resolve().parents[2]
SYSTEM = list(range(100, 148))  # 3 blocks


def test_connector_over_mooncake_in_private_network_namespace(netns_run):  # noqa: F811
    """Runs `TestConnectorOverMooncake` in a fresh network namespace that has only loopback."""
    assert find_binary("mooncake_master") and find_binary("mooncake_http_metadata_server"), \
        "Mooncake binaries missing next to the venv's python: run scripts/install_mooncake.sh"
    r = netns_run([sys.executable, "-m", "pytest", str(Path(__file__)), "-p", "no:cacheprovider",
                   "-p", "no:randomly", "-x", "-q"], env={"HICACHE_TEST_NETNS": "1"}, cwd=str(REPO), timeout=240)
    if r.returncode == 97:
        pytest.fail(f"cannot create a private network namespace here: {r.stderr.strip()}")
    summary = [line for line in r.stdout.splitlines() if " passed" in line or " failed" in line or "error" in line]
    assert r.returncode == 0, f"inner run failed ({r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert summary and "passed" in summary[-1] and "skipped" not in summary[-1], r.stdout[-2000:]


test_connector_over_mooncake_in_private_network_namespace.__test__ = not IN_NETNS  # type: ignore[attr-defined]


class TestConnectorOverMooncake:
    __test__ = IN_NETNS

    def test_pages_one_instance_stored_in_mooncake_are_loaded_by_a_fresh_one(self, mooncake_cluster, tmp_path):  # noqa: F811
        """A serves three sessions and writes its backed-up pages to Mooncake; B, a fresh instance
        on the same cluster (empty GPU cache and host tier), loads their prefixes from Mooncake
        and computes only what A had not stored; outputs equal a plain vLLM's."""
        model = str(tmp_path / "model")
        save_tiny_model(model)
        options = {"master_server_address": mooncake_cluster.master_address,
                   "metadata_server": mooncake_cluster.metadata_url, "local_hostname": "127.0.0.1",
                   "tcp_bind_address": "127.0.0.1", "global_segment_size": "64MiB", "local_buffer_size": "16MiB",
                   "key_prefix": "vllm-test/"}

        def engine(connector: str | None = "HiCacheConnector") -> FakeEngine:
            extra = {"host_blocks": 64, "storage_backend": "mooncake", "mooncake": options}
            return FakeEngine(vllm_config(model, connector=connector, extra=extra if connector else None), 32)

        def serve(e: FakeEngine) -> None:
            for s in range(3):
                e.add(f"s{s}", SYSTEM + [200 + s] * 20 + [7], 3)
            e.run()

        a = engine()
        scheduler_store, worker_store = a.connector.storage.inner, a.worker.storage.inner  # (health-tracked)
        assert isinstance(scheduler_store, MooncakeBackend) and isinstance(worker_store, MooncakeBackend)
        assert scheduler_store.config.global_segment_size == 0  # the scheduler only asks what exists
        assert worker_store.config.global_segment_size == 64 << 20
        serve(a)
        a.assert_drained()
        assert a.connector.core.storage.stats["storage_pages_written"] == 3 * 4  # 4 full blocks per prompt
        plain, b = engine(None), engine()  # (A stays up: its worker holds the pool's memory)
        for e in (plain, b):
            serve(e)
        stats = b.connector.core.stats
        # every stored block staged into host pages before it was reported (`tokens_storage_loaded`
        # counts a load's part from its own staging: less where a sibling's put the shared prefix in
        # the host tier first)
        assert stats["stagings"] == 3 and stats["tokens_staged"] == 3 * 4 * BLOCK and stats["stagings_short"] == 0
        assert stats["tokens_storage_loaded"] > 0 and stats["load_errors"] == 0
        assert b.outputs == plain.outputs
        # B computed each prompt's last 5 tokens and 2 decode steps; plain computed s0 whole (69 + 2)
        assert plain.computed["s0"] == 71 and b.computed == {rid: 71 - 4 * BLOCK for rid in plain.computed}
        b.assert_drained()
        for e in (b, a):
            for side in (e.scheduler.connector,):
                side.shutdown()
            for w in e.workers:
                w.shutdown()
