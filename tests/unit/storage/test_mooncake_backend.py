"""MooncakeBackend against a real local Mooncake Store (master + metadata server on 127.0.0.1).

The tests of `TestMooncakeBackend` run in a private network namespace: the launcher test
below re-runs this file there (Mooncake clients listen on every interface; inside, there is
only loopback). They skip only when the Mooncake package is not installed
(scripts/install_mooncake.sh installs it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip(
    "mooncake.store",
    reason="Mooncake is not installed (pip mooncake-transfer-engine-non-cuda + Debian libibverbs1): "
           "run scripts/install_mooncake.sh",
)

from runtime.errors import ConfigError, StateError, ValidationError  # noqa: E402
from runtime.storage.backend import StorageBackend  # noqa: E402
from runtime.storage.mooncake_backend import MooncakeBackend  # noqa: E402
from runtime.storage.mooncake_config import MooncakeConfig, parse_size  # noqa: E402
from runtime.storage.mooncake_cluster import find_binary  # noqa: E402

IN_NETNS = os.environ.get("HICACHE_TEST_NETNS") == "1" or os.environ.get("HICACHE_MOONCAKE_HOST_NETNS") == "1"
REPO = Path(__file__).resolve().parents[3]
PB = 64 * 1024


def key(i: int, tag: str = "m") -> bytes:
    return f"{tag}{i:06d}".encode().ljust(16, b".")


def page(i: int, nbytes: int = PB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def test_mooncake_in_private_network_namespace(netns_run):
    """Runs `TestMooncakeBackend` in a fresh network namespace that has only loopback."""
    assert find_binary("mooncake_master") and find_binary("mooncake_http_metadata_server"), \
        "Mooncake binaries missing next to the venv's python: run scripts/install_mooncake.sh"
    r = netns_run([sys.executable, "-m", "pytest", str(Path(__file__)), "-p", "no:cacheprovider",
                   "-p", "no:randomly", "-x"], env={"HICACHE_TEST_NETNS": "1"}, cwd=str(REPO), timeout=240)
    if r.returncode == 97:
        pytest.fail(f"cannot create a private network namespace here: {r.stderr.strip()}")
    summary = [line for line in r.stdout.splitlines() if " passed" in line or " failed" in line or "error" in line]
    assert r.returncode == 0, f"inner run failed ({r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert summary and "passed" in summary[-1] and "skipped" not in summary[-1], r.stdout[-2000:]


test_mooncake_in_private_network_namespace.__test__ = not IN_NETNS  # type: ignore[attr-defined]


def test_config_parsing(tmp_path):
    assert parse_size("512mb") == 512 << 20 and parse_size("4GB") == 4 << 30 and parse_size(123) == 123
    c = MooncakeConfig.from_env({"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_TE_META_DATA_SERVER":
                                 "http://10.0.0.1:8080/metadata", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb",
                                 "MOONCAKE_PROTOCOL": "rdma", "MOONCAKE_DEVICE": "mlx5_0"})
    assert (c.master_server_address, c.global_segment_size, c.protocol, c.device_name) == \
        ("10.0.0.1:50051", 4 << 30, "rdma", "mlx5_0")
    p = tmp_path / "mc.json"
    p.write_text('{"master_server_address": "h:1", "metadata_server": "P2PHANDSHAKE", "local_buffer_size": "1mb"}')
    assert MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(p)}).local_buffer_size == 1 << 20
    with pytest.raises(ConfigError):
        MooncakeConfig.from_env({})
    with pytest.raises(ConfigError):
        MooncakeConfig(master_server_address="nohost", metadata_server="P2PHANDSHAKE")
    with pytest.raises(ConfigError):
        MooncakeConfig.from_dict({"master_server_address": "h:1", "metadata_server": "x", "bogus": 1})


@pytest.fixture(scope="module")
def backend(mooncake_cluster):
    b = MooncakeBackend(PB, mooncake_cluster.config(global_segment_size=64 << 20, local_buffer_size=32 << 20))
    yield b
    b.close()


class TestMooncakeBackend:
    __test__ = IN_NETNS

    def test_isolated(self):
        # only loopback here: the client's all-interface listeners are unreachable from outside
        names = [n for _i, n in socket.if_nameindex()]
        assert names == ["lo"] or os.environ.get("HICACHE_MOONCAKE_HOST_NETNS") == "1"

    def test_protocol(self, backend):
        assert isinstance(backend, StorageBackend)

    def test_round_trip_plain_buffers(self, backend):
        keys = [key(i, "rt") for i in range(4)]
        srcs = [page(0), bytes(page(1)), torch.from_numpy(page(2).copy()).view(torch.bfloat16), bytearray(page(3))]
        assert backend.set_batch(keys, srcs) == [True] * 4
        dests = [np.zeros(PB, np.uint8), bytearray(PB), torch.zeros(PB // 2, dtype=torch.bfloat16),
                 memoryview(bytearray(PB))]
        assert backend.get_batch(keys, dests) == [True] * 4
        assert np.array_equal(dests[0], page(0)) and bytes(dests[1]) == bytes(page(1))
        assert np.array_equal(dests[2].view(torch.uint8).numpy(), page(2)) and bytes(dests[3]) == bytes(page(3))
        # pages are immutable: writing a present key again is a success
        assert backend.set_batch(keys[:1], [page(0)]) == [True]

    def test_prefix_existence_and_misses(self, backend):
        keys = [key(i, "px") for i in range(5)]
        assert backend.exists_prefix(keys) == 0
        backend.set_batch([keys[0], keys[1], keys[3]], [page(10), page(11), page(13)])
        assert backend.exists_prefix(keys) == 2
        assert backend.exists_prefix(keys[3:]) == 1
        dests = [np.zeros(PB, np.uint8) for _ in keys]
        assert backend.get_batch(keys, dests) == [True, True, False, True, False]
        assert np.array_equal(dests[3], page(13))

    def test_remove(self, backend):
        """`clear_storage`'s call: the named pages and their tags go, at once after a read (a
        read lease does not keep them: the removal is forced); others stay."""
        keys = [key(i, "rm") for i in range(4)]
        assert backend.set_batch(keys, [page(30 + i) for i in range(4)]) == [True] * 4
        assert backend.get_batch(keys[:1], [np.zeros(PB, np.uint8)]) == [True]  # a lease on keys[0]
        assert backend.remove([keys[0], keys[2], key(99, "rm")]) == 2
        assert backend.get_batch(keys, [np.zeros(PB, np.uint8) for _ in keys]) == [False, True, False, True]
        assert backend.set_batch(keys[:1], [page(30)]) == [True] and backend.exists_prefix(keys) == 2

    def test_get_prefix_without_an_existence_call(self, backend):
        keys = [key(i, "gp") for i in range(5)]
        backend.set_batch([keys[0], keys[1], keys[3]], [page(20), page(21), page(23)])
        pool = torch.zeros(5, PB, dtype=torch.uint8)
        backend.register_buffer(pool)
        try:
            before = backend.stats()
            assert backend.get_prefix(keys, [pool[i] for i in range(5)]) == 2
            assert np.array_equal(pool[0].numpy(), page(20)) and np.array_equal(pool[1].numpy(), page(21))
            assert backend.get_prefix(keys[2:3], [pool[2]]) == 0
            plain = [np.zeros(PB, np.uint8) for _ in range(2)]  # unregistered: through the staging buffer
            assert backend.get_prefix(keys[:2], plain) == 2 and np.array_equal(plain[1], page(21))
            after = backend.stats()
            assert after["exists_calls"] == before["exists_calls"]
            assert after["zero_copy_pages_read"] - before["zero_copy_pages_read"] >= 2
        finally:
            backend.unregister_buffer(pool)

    def test_zero_copy_path(self, backend):
        pool = torch.zeros(8, PB, dtype=torch.uint8)  # a page-first host pool stand-in
        backend.register_buffer(pool)
        try:
            for i in range(4):
                pool[i] = torch.from_numpy(page(100 + i))
            keys = [key(i, "zc") for i in range(4)]
            before = backend.stats()
            assert backend.set_batch(keys, [pool[i] for i in range(4)]) == [True] * 4
            # mixed batch: two registered destinations, one plain
            plain = np.zeros(PB, np.uint8)
            assert backend.get_batch(keys[:3], [pool[4], pool[5], plain]) == [True] * 3
            after = backend.stats()
            assert after["zero_copy_pages_written"] - before["zero_copy_pages_written"] == 4
            assert after["zero_copy_pages_read"] - before["zero_copy_pages_read"] == 2
            assert torch.equal(pool[4], pool[0]) and torch.equal(pool[5], pool[1])
            assert np.array_equal(plain, page(102))
            with pytest.raises(ConfigError):
                backend.register_buffer(pool[2:4])  # overlaps
        finally:
            backend.unregister_buffer(pool)
        assert backend.stats()["registered_buffers"] == 0

    @pytest.mark.parametrize("staging_pages", [0, 2])
    def test_plain_reads_without_or_with_a_small_staging_buffer(self, mooncake_cluster, staging_pages):
        b = MooncakeBackend(PB, mooncake_cluster.config(global_segment_size=0, local_buffer_size=8 << 20),
                            staging_bytes=staging_pages * PB)
        try:
            keys = [key(i, f"st{staging_pages}") for i in range(5)]
            assert b.set_batch(keys, [page(400 + i) for i in range(5)]) == [True] * 5
            dests = [np.zeros(PB, np.uint8) for _ in range(6)]
            assert b.get_batch(keys + [key(99, "nope")], dests) == [True] * 5 + [False]
            assert all(np.array_equal(dests[i], page(400 + i)) for i in range(5))
        finally:
            b.close()

    def test_wrong_size_object_is_a_miss(self, backend):
        backend._store.put(backend._keys([key(1, "ws")])[0], b"short")
        assert backend.exists_prefix([key(1, "ws")]) == 1  # present, but not a page of ours
        assert backend.get_batch([key(1, "ws")], [np.zeros(PB, np.uint8)]) == [False]

    def test_every_page_keeps_its_tag(self, backend):
        """Each page has a companion tag object (the storage tier's tag, stored and handed back
        as is). A page without a tag is a miss; `read_prefix` refuses a page whose bytes do not
        match its tag (a flipped byte; another key's page and tag copied under this key), on the
        zero-copy path too, and removes it; a write over a page with another tag replaces it."""
        from runtime.storage.backend import read_prefix, write_pages
        from runtime.storage.integrity import PageSeal
        from runtime.storage.mooncake_backend import TAG_SUFFIX

        seal = PageSeal()
        good = [key(i, "ck") for i in range(3)]
        assert write_pages(backend, good, [page(500 + i) for i in range(3)], seal) == (True,) * 3
        sk = backend._keys(good)
        assert backend._store.batch_is_exist([k + TAG_SUFFIX for k in sk]) == [1, 1, 1]
        tags: list = [None] * 3
        dests = [np.zeros(PB, np.uint8) for _ in range(3)]
        assert backend.get_batch(good, dests, tags) == [True] * 3
        assert tags == seal.tags(good, [page(500 + i) for i in range(3)])
        put = backend._store.put
        flipped, forged, untagged = key(0, "ckflip"), key(0, "ckforge"), key(0, "cknotag")
        bad = page(510).copy()
        bad[PB // 2] ^= 0x01
        fk, gk, uk = backend._keys([flipped, forged, untagged])
        assert put(fk, bad.tobytes()) == 0 and put(fk + TAG_SUFFIX, seal.tag(flipped, page(510))) == 0
        assert put(gk, page(500).tobytes()) == 0  # page 0 and its tag, copied under another key
        assert put(gk + TAG_SUFFIX, bytes(backend._store.get(sk[0] + TAG_SUFFIX))) == 0
        assert put(uk, page(511).tobytes()) == 0
        dests = [np.zeros(PB, np.uint8) for _ in range(4)]
        assert backend.get_batch([good[0], flipped, forged, untagged], dests) == [True, True, True, False]
        before = seal.rejected
        assert read_prefix(backend, [good[0], good[1], flipped], dests[:3], seal) == 2
        assert seal.rejected == before + 1 and backend.exists_prefix([flipped]) == 0  # refused: removed
        pool = torch.zeros(3, PB, dtype=torch.uint8)  # zero-copy reads are checked in place
        backend.register_buffer(pool)
        try:
            assert read_prefix(backend, [forged, good[2]], [pool[0], pool[1]], seal) == 0
            assert seal.rejected == before + 2
            assert read_prefix(backend, good, [pool[i] for i in range(3)], seal) == 3
            assert all(np.array_equal(pool[i].numpy(), page(500 + i)) for i in range(3))
        finally:
            backend.unregister_buffer(pool)
        # a page present under another tag is not this page: the write replaces it
        other = PageSeal("another key, 16 bytes or more")
        assert read_prefix(backend, good[:1], dests[:1], other) == 0  # (refused, and removed)
        assert write_pages(backend, good[1:2], [page(501)], other) == (True,)
        assert read_prefix(backend, good[1:2], dests[:1], other) == 1 and np.array_equal(dests[0], page(501))

    @pytest.mark.parametrize("layout", ["layer_first", "page_first"])
    def test_runtime_refuses_lying_transfers_and_forged_pages(self, mooncake_cluster, layout):
        """The storage tier's check through the runtime on Mooncake: bytes flipped after the backend
        returned (a lying transfer, into the registered pool on page_first) and pages planted
        without the storage key are never served, and counted (tests/integration/test_storage_integrity.py)."""
        import asyncio

        from tests.integration.test_storage_integrity import forged_pages, lying_transport

        def factory(prefix: str):  # one key prefix per scenario: its runtimes share the pages
            return lambda config: MooncakeBackend(
                config.page_size * config.bytes_per_token,
                mooncake_cluster.config(global_segment_size=16 << 20, local_buffer_size=16 << 20, key_prefix=prefix))

        asyncio.run(lying_transport(factory(f"lying-{layout}/"), layout))
        asyncio.run(forged_pages(factory(f"forged-{layout}/"), layout))

    def test_validation(self, backend):
        with pytest.raises(ValidationError):
            backend.set_batch([key(0)], [np.zeros(PB - 1, np.uint8)])
        with pytest.raises(ValidationError):
            backend.get_batch([key(0)], [bytes(PB)])

    def test_two_processes_share_the_store(self, backend, mooncake_cluster):
        keys_a = [key(i, "pa") for i in range(6)]
        assert backend.set_batch(keys_a, [page(200 + i) for i in range(6)]) == [True] * 6
        child = textwrap.dedent(f"""
            import sys, numpy as np
            from runtime.storage.mooncake_backend import MooncakeBackend
            from runtime.storage.mooncake_config import MooncakeConfig
            PB = {PB}
            def key(i, tag): return f"{{tag}}{{i:06d}}".encode().ljust(16, b".")
            def page(i): return np.random.default_rng(i).integers(0, 256, PB, dtype=np.uint8)
            cfg = MooncakeConfig(master_server_address={mooncake_cluster.master_address!r},
                                 metadata_server={mooncake_cluster.metadata_url!r}, local_hostname="127.0.0.1",
                                 tcp_bind_address="127.0.0.1", global_segment_size=32 << 20,
                                 local_buffer_size=16 << 20)
            b = MooncakeBackend(PB, cfg)
            ka = [key(i, "pa") for i in range(6)]
            assert b.exists_prefix(ka) == 6, b.exists_prefix(ka)
            buf = np.zeros((6, PB), np.uint8)
            b.register_buffer(buf)
            assert b.get_batch(ka, [buf[i] for i in range(6)]) == [True] * 6
            assert all(np.array_equal(buf[i], page(200 + i)) for i in range(6))
            kb = [key(i, "pb") for i in range(3)]
            assert b.set_batch(kb, [page(300 + i) for i in range(3)]) == [True] * 3
            print("WRITTEN", flush=True)
            sys.stdin.readline()  # stay alive (its segment holds data) until the parent has read
            b.close()
            print("DONE", flush=True)
        """)
        p = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(REPO))
        try:
            line = p.stdout.readline()
            if line.strip() != "WRITTEN":
                p.kill()
                _out, err = p.communicate(timeout=10)
                pytest.fail(f"child failed: {line!r}\n{err[-3000:]}")
            kb = [key(i, "pb") for i in range(3)]
            assert backend.exists_prefix(kb) == 3
            dests = [np.zeros(PB, np.uint8) for _ in kb]
            assert backend.get_batch(kb, dests) == [True] * 3
            assert all(np.array_equal(d, page(300 + i)) for i, d in enumerate(dests))
            out, err = p.communicate("go\n", timeout=30)
            assert p.returncode == 0 and "DONE" in out, err[-3000:]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()

    @pytest.mark.parametrize("layout", ["layer_first", "page_first"])
    def test_runtime_round_trip(self, mooncake_cluster, layout):
        """The storage tier through the runtime: back up a prefix, flush, admit it again from Mooncake.
        A page_first host pool is registered by the runtime (zero-copy both ways) and unregistered
        when it closes; a layer_first one goes through the plain path."""
        import asyncio

        from runtime.runtime import CacheRuntime
        from tests.integration.test_storage_tier import N, cfg, quiescent, readmit_ok, serve, toks

        config = cfg(host_layout=layout)
        b = MooncakeBackend(config.page_size * config.bytes_per_token,
                            mooncake_cluster.config(global_segment_size=16 << 20, local_buffer_size=16 << 20,
                                                    key_prefix=f"rt-{layout}/"))
        pages = N // config.page_size
        zero_copy = layout == "page_first"

        async def main() -> None:
            a = toks(N + 1, 77)
            async with CacheRuntime.open(config, storage=b) as rt:
                assert b.stats()["registered_buffers"] == int(zero_copy)
                await serve(rt, "a", a)
                assert (await rt.stats())["storage"]["written_pages"] == pages
                await rt.flush()
                assert await readmit_ok(rt, "b", a) == N  # fingerprints checked
                assert (await rt.stats())["storage"]["hit_tokens"] == N
                await quiescent(rt)
            st = b.stats()
            assert st["registered_buffers"] == 0  # the runtime unregistered its pool
            assert st["zero_copy_pages_written"] == (pages if zero_copy else 0)
            assert st["zero_copy_pages_read"] == (pages if zero_copy else 0)
            # one lookup per prefetch (serve's cold admit and the re-admit), then one get_prefix pass
            assert st["pages_read"] == pages and st["exists_calls"] == 2 and st["get_calls"] == 1

        try:
            asyncio.run(main())
        finally:
            b.close()

    @pytest.mark.parametrize("source", ["env", "json"])
    def test_runtime_builds_the_backend_from_config(self, mooncake_cluster, monkeypatch, tmp_path, source):
        """`storage_backend="mooncake"`: the runtime builds `MooncakeBackend` from the environment
        (`MooncakeConfig.from_env`: MOONCAKE_* variables, or MOONCAKE_CONFIG_PATH), registers its
        page_first host pool, serves a prefix back from Mooncake and closes the backend it owns."""
        import asyncio
        import json

        from runtime.runtime import CacheRuntime
        from tests.integration.test_storage_tier import N, cfg, quiescent, readmit_ok, serve, toks

        for var in [v for v in os.environ if v.startswith("MOONCAKE_")]:
            monkeypatch.delenv(var)
        prefix = f"fromcfg-{source}/"
        if source == "env":
            for var, value in (("MOONCAKE_MASTER", mooncake_cluster.master_address),
                               ("MOONCAKE_TE_META_DATA_SERVER", mooncake_cluster.metadata_url),
                               ("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"), ("MOONCAKE_TCP_BIND_ADDRESS", "127.0.0.1"),
                               ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "16mb"), ("MOONCAKE_LOCAL_BUFFER_SIZE", "16mb"),
                               ("MOONCAKE_PROTOCOL", "tcp"), ("MOONCAKE_KEY_PREFIX", prefix)):
                monkeypatch.setenv(var, value)
        else:
            path = tmp_path / "mooncake.json"
            path.write_text(json.dumps({
                "master_server_address": mooncake_cluster.master_address,
                "metadata_server": mooncake_cluster.metadata_url, "local_hostname": "127.0.0.1",
                "tcp_bind_address": "127.0.0.1", "global_segment_size": "16mb", "local_buffer_size": "16mb",
                "key_prefix": prefix}))
            monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
        config = cfg(storage_backend="mooncake", host_layout="page_first")
        pages = N // config.page_size
        seen: dict[str, object] = {}

        async def main() -> None:
            a = toks(N + 1, 78)
            async with CacheRuntime.open(config) as rt:
                b = rt.storage
                seen["backend"] = b
                assert isinstance(b, MooncakeBackend)
                assert b.page_bytes == config.page_size * config.bytes_per_token
                assert (b.config.master_server_address, b.config.metadata_server, b.config.key_prefix) == \
                    (mooncake_cluster.master_address, mooncake_cluster.metadata_url, prefix)
                assert b.config.global_segment_size == 16 << 20
                assert b.stats()["registered_buffers"] == 1  # the host pool
                await serve(rt, "a", a)
                assert (await rt.stats())["storage"]["written_pages"] == pages
                await rt.flush()
                assert await rt.match_prefix(a) == {"device": 0, "host": 0}
                assert await readmit_ok(rt, "b", a) == N  # fingerprints checked
                st = await rt.stats()
                assert st["storage"]["hit_tokens"] == N and st["storage"]["errors"] == 0
                bs = b.stats()
                assert bs["zero_copy_pages_written"] == pages and bs["zero_copy_pages_read"] == pages
                await quiescent(rt)

        asyncio.run(main())
        b = seen["backend"]
        with pytest.raises(StateError):  # the runtime owned it and closed it
            b.exists_prefix([key(0)])

    def test_close(self, mooncake_cluster):
        b = MooncakeBackend(PB, mooncake_cluster.config(global_segment_size=0, local_buffer_size=4 << 20))
        b.close()
        b.close()
        with pytest.raises(StateError):
            b.exists_prefix([key(0)])

    def test_z_overfilling_the_store_fails_or_evicts_per_page(self, backend):
        # the pool holds ~(64 + a few) MiB here; write 160 MiB of pages: no exception, per-page results,
        # and whatever is still present reads back right (runs last in this class: it evicts)
        keys = [key(i, "fill") for i in range(2560)]
        res = []
        for start in range(0, len(keys), 64):
            res += backend.set_batch(keys[start:start + 64], [page(i % 13) for i in range(start, start + 64)])
        assert all(isinstance(r, bool) for r in res) and sum(res) > 0
        present = [i for i in range(0, len(keys), 97) if backend.exists_prefix([keys[i]])]
        for i in present:
            d = np.zeros(PB, np.uint8)
            if backend.get_batch([keys[i]], [d]) == [True]:
                assert np.array_equal(d, page(i % 13))
