"""The fleet secret (``--kv-secret-file``): with it, a replica loads only L2 chunks signed by a holder of the same
secret, so writing the shared store is no longer enough to make a replica serve chosen K/V."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvchunks import FP, chunk, expect, key, same
from preheat.core.errors import ConfigError, CorruptChunkError, MacError
from preheat.kv import chunkfile, mac
from preheat.kv.chunk import StoredChunk, decode_chunk, encode_chunk
from preheat.kv.fs import FileTier
from preheat.kv.redis_tier import RedisTier
from preheat.kv.settings import KVSettings
from preheat.server.settings import ServeSettings
from preheat.testing.redisserver import RedisServer

KEY = mac.derive_key(b"the fleet's secret, 32 bytes ok!")
OTHER = mac.derive_key(b"another fleet's secret, also ok!")


def keyed(mac_key: bytes | None = KEY, fp: str = FP) -> chunkfile.Expect:
    plain = expect(fp=fp)
    return chunkfile.Expect(plain.fingerprint, plain.dtype, plain.shape, mac_key=mac_key)


def encoded(mac_key: bytes | None, c: StoredChunk | None = None) -> bytearray:
    return bytearray(b"".join(encode_chunk(key(0), FP, c or chunk(0), mac_key)))


def forged() -> StoredChunk:
    """K/V of the forger's choosing: all zeros, a chunk no prompt produces."""
    return StoredChunk(torch.zeros_like(chunk(0).data))


# -- the format ----------------------------------------------------------------------------------------------------


def test_a_keyed_chunk_round_trips_and_carries_a_tag() -> None:
    blob = encoded(KEY)
    assert int.from_bytes(blob[8:12], "little") == chunkfile.VERSION_KEYED
    assert len(blob) == len(encoded(None)) + mac.TAG_BYTES
    assert same(decode_chunk(blob, key(0), keyed()), chunk(0))


def test_a_chunk_signed_under_another_secret_is_refused() -> None:
    with pytest.raises(MacError, match="MAC mismatch"):
        decode_chunk(encoded(OTHER), key(0), keyed())


@pytest.mark.parametrize("offset", [0, 9, 16, 100, -mac.TAG_BYTES - 1, -1])
def test_any_changed_byte_of_a_keyed_chunk_is_refused(offset: int) -> None:
    blob = encoded(KEY)
    blob[offset] ^= 0x01
    with pytest.raises(CorruptChunkError):
        decode_chunk(blob, key(0), keyed())


def test_a_forger_who_fixes_the_checksum_is_caught_only_by_the_mac() -> None:
    # The forger swaps the payload of a genuine chunk and rewrites the header's checksum: every unkeyed check passes.
    genuine = encoded(KEY)
    evil = encoded(None, forged())
    head_len = 16 + int.from_bytes(evil[12:16], "little")
    planted = evil[:head_len]
    planted[8:12] = chunkfile.VERSION_KEYED.to_bytes(4, "little")
    planted += evil[head_len:] + genuine[-mac.TAG_BYTES :]
    with pytest.raises(MacError):
        decode_chunk(planted, key(0), keyed())
    served = decode_chunk(evil, key(0), expect())  # what a fleet without a secret loads: the forger's K/V
    assert torch.count_nonzero(served.data) == 0


def test_unkeyed_and_keyed_readers_refuse_each_others_chunks() -> None:
    with pytest.raises(MacError, match="unkeyed"):
        decode_chunk(encoded(None), key(0), keyed())
    with pytest.raises(MacError, match="no secret"):
        decode_chunk(encoded(KEY), key(0), expect())


def test_the_mac_key_never_shows_in_a_repr() -> None:
    assert KEY.hex() not in repr(keyed())
    assert repr(KEY) not in repr(keyed())


# -- the tiers -----------------------------------------------------------------------------------------------------


def test_fs_planted_chunks_are_misses_for_a_keyed_fleet(tmp_path: Path) -> None:
    attacker = FileTier(str(tmp_path), expect())  # can write the directory, has no secret
    attacker.put(key(0), forged())
    replica = FileTier(str(tmp_path), keyed())
    assert replica.get(key(0)) is None
    assert replica.stats.snapshot()["mac_failures"] == 1
    assert replica.stats.snapshot()["corrupt"] == 1
    assert not Path(replica.path(key(0))).exists()  # removed, as any chunk that fails its checks
    assert replica.put(key(0), chunk(0))
    other_fleet = FileTier(str(tmp_path), keyed(OTHER))
    assert other_fleet.get(key(0)) is None
    assert replica.put(key(0), chunk(0))
    peer = FileTier(str(tmp_path), keyed())  # another replica of the same fleet
    found = peer.get(key(0))
    assert found is not None
    assert same(found, chunk(0))


def test_fs_store_replaces_a_planted_chunk_that_passes_every_check_but_the_mac(tmp_path: Path) -> None:
    FileTier(str(tmp_path), expect()).put(key(0), forged())
    replica = FileTier(str(tmp_path), keyed())
    assert replica.put(key(0), chunk(0))  # the planted file is not taken for the chunk: it is replaced
    found = FileTier(str(tmp_path), keyed()).get(key(0))
    assert found is not None
    assert same(found, chunk(0))


def test_redis_planted_chunks_are_misses_for_a_keyed_fleet(redis_server: RedisServer) -> None:
    attacker = RedisTier(redis_server.url, expect(fp="d" * 32))
    attacker.put(key(0), forged())
    replica = RedisTier(redis_server.url, keyed(fp="d" * 32))
    assert replica.get(key(0)) is None
    assert replica.stats.snapshot()["mac_failures"] == 1
    assert replica.client.exists(replica.prefix + key(0)) == 0
    assert replica.put(key(0), chunk(0))
    found = RedisTier(redis_server.url, keyed(fp="d" * 32)).get(key(0))
    assert found is not None
    assert same(found, chunk(0))
    assert RedisTier(redis_server.url, keyed(OTHER, fp="d" * 32)).get(key(0)) is None
    for tier in (attacker, replica):
        tier.close()


# -- the secret file -----------------------------------------------------------------------------------------------


def secret_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "kv.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


def test_a_secret_file_gives_the_same_key_with_or_without_a_final_newline(tmp_path: Path) -> None:
    one = mac.read_secret_file(secret_file(tmp_path, b"9f" * 32 + b"\n"))
    two = mac.read_secret_file(secret_file(tmp_path, b"9f" * 32))
    assert one == two == b"9f" * 32


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b"  \n", "empty"),
        (b"short\n", "too short"),
        (b"x" * (mac.MAX_SECRET_FILE_BYTES + 1), "right file"),
    ],
)
def test_an_unusable_secret_file_is_a_config_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = secret_file(tmp_path, content)
    with pytest.raises(ConfigError, match=message) as caught:
        mac.read_secret_file(path)
    assert path in str(caught.value)


def test_a_missing_or_non_regular_secret_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no such file.*openssl rand"):
        mac.read_secret_file(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="not a regular file"):
        mac.read_secret_file(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        mac.read_secret_file(str(fifo))  # and it does not wait for a writer


def test_a_world_readable_secret_file_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="preheat.kv"):
        mac.read_secret_file(secret_file(tmp_path, b"a" * 32, 0o600))
        assert not caplog.records
        mac.read_secret_file(secret_file(tmp_path, b"a" * 32, 0o644))
    assert "readable by every user" in caplog.text
    assert "chmod 600" in caplog.text


def test_the_secret_is_checked_with_the_settings_before_anything_loads(tmp_path: Path) -> None:
    l2 = f"fs://{tmp_path}"
    with pytest.raises(ConfigError, match="--kv-secret-file"):
        KVSettings(l2=l2, secret_file=str(tmp_path / "nope")).check()
    with pytest.raises(ConfigError, match="give --kv-l2 too"):
        KVSettings(l1="16MiB", secret_file=secret_file(tmp_path, b"b" * 32)).check()
    env = {"PREHEAT_KV_SECRET_FILE": secret_file(tmp_path, b"b" * 32), "PREHEAT_KV_L2": l2}
    settings = ServeSettings.resolve({"model": str(tmp_path)}, env)
    assert settings.kv.secret_file == env["PREHEAT_KV_SECRET_FILE"]


def test_serve_with_a_missing_secret_file_fails_before_binding(tmp_path: Path) -> None:
    missing = str(tmp_path / "kv.secret")
    command = [
        sys.executable,
        "-m",
        "preheat",
        "serve",
        str(tmp_path),
        "--port",
        "0",
        "--kv-l2",
        f"fs://{tmp_path}",
        "--kv-secret-file",
        missing,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "listening" not in done.stdout
    assert f"--kv-secret-file {missing}: no such file" in done.stderr


# -- Redis URLs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://:hunter2@host:port/0", "port"),
        ("redis://:hunter2@:6379/0", "no host"),
        ("redis://:hunter2@host:6379/zero", "not a number"),
        ("redis://:hunter2@host:6379/0?ssl_ca_certs=/ca.pem", "rediss://"),
        ("rediss://:hunter2@host:6379/0?sslcacerts=/ca.pem", "unknown option"),
    ],
)
def test_a_bad_redis_url_is_refused_without_repeating_its_password(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        KVSettings(l2=url).check()
    assert "hunter2" not in str(caught.value)


def test_a_redis_url_with_tls_options_and_credentials_is_accepted() -> None:
    KVSettings(l2="rediss://kv:s3cret@redis.internal:6380/2?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required").check()
