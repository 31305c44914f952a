"""The KV storage registry (``preheat.kv.backends``): one table picks the storage of an ``fs://`` or ``redis://`` URL,
an unknown scheme is refused naming every known one, and no other KV module tells schemes apart itself."""

from __future__ import annotations

from pathlib import Path

import pytest

import preheat
from codescan import literal_tests
from preheat.core.errors import ConfigError
from preheat.kv import backends, chunkfile
from preheat.kv.settings import KVSettings

SRC = Path(preheat.__file__).parent
# The modules that open, list or configure KV storage: the registry must be the only one of them comparing schemes.
STORAGE_MODULES = sorted([*(SRC / "kv").glob("*.py"), *(SRC / "integrations").rglob("*.py")])
EXPECT = chunkfile.BlobExpect("0" * 32, 1 << 20)


@pytest.mark.parametrize("url", ["s3://bucket/kv", "memcached://:pw@cache:11211", "/shared/kv", "FS:///shared/kv"])
def test_an_unknown_scheme_is_refused_naming_every_known_one(url: str) -> None:
    for refuse in (backends.check_url, backends.list_namespaces, lambda u: backends.open_l2(u, EXPECT)):
        with pytest.raises(ConfigError) as caught:
            refuse(url)
        message = str(caught.value)
        assert all(f"{scheme}://" in message for scheme in backends.BACKENDS), message
        assert "pw" not in message  # never repeats a password


def test_the_flag_names_the_setting_that_was_refused() -> None:
    with pytest.raises(ConfigError, match=r"^--kv-l2 's3://bucket/kv': unknown scheme 's3'; use fs:///"):
        KVSettings(l2="s3://bucket/kv").check()


@pytest.mark.parametrize("scheme", list(backends.BACKENDS))
def test_every_registered_scheme_resolves_to_its_opener_and_lister(scheme: str) -> None:
    backend = backends.BACKENDS[scheme]
    assert backends.backend_for(backend.example) is backend
    assert backends.check_url(backend.example) is backend  # its own example is a URL it accepts
    assert callable(backends.resolve(backend.opener))
    assert callable(backends.resolve(backend.lister))


def test_an_fs_url_opens_a_directory_that_takes_values(tmp_path: Path) -> None:
    tier = backends.open_l2(f"fs://{tmp_path / 'kv'}", EXPECT, max_bytes=1 << 30)
    try:
        assert tier.up
        assert tier.describe() == f"fs://{tmp_path / 'kv'}"
        assert (tmp_path / "kv").is_dir()  # made: its parent exists
    finally:
        tier.close()
    assert backends.list_namespaces(f"fs://{tmp_path / 'kv'}") == [("0" * 32, None)]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("fs://relative/kv", "absolute path"),
        ("redis://:pw@host:notaport/0", "port"),
        ("rediss://:pw@host:6380/x", "not a number"),
    ],
)
def test_each_scheme_refuses_its_own_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        backends.open_l2(url, EXPECT)
    assert "pw" not in str(caught.value)


def test_a_quota_is_refused_where_the_storage_keeps_its_own() -> None:
    with pytest.raises(ConfigError, match="a quota is for an fs:// store"):
        backends.open_l2("redis://127.0.0.1:1/0", EXPECT, max_bytes=1 << 30)
    with pytest.raises(ConfigError, match="--kv-l2-max-bytes is the quota of an fs:// L2"):
        KVSettings(l2="redis://127.0.0.1:6379/0", l2_max_bytes="1GiB").check()


def _scheme_comparisons(path: Path) -> list[str]:
    """Where ``path`` tells URL schemes apart itself, by a ``"...://"`` literal."""
    return [f"{path.name}:{line}" for line in literal_tests(path, lambda text: "://" in text)]


def test_no_kv_module_but_the_registry_compares_url_schemes() -> None:
    assert any(p.name == "backends.py" for p in STORAGE_MODULES)
    found = [hit for p in STORAGE_MODULES if p.name != "backends.py" for hit in _scheme_comparisons(p)]
    assert found == [], "dispatch on a URL's scheme in kv/backends.py only"
    assert _scheme_comparisons(SRC / "kv" / "backends.py")  # the check sees what it looks for
