"""A node-cache entry has a name, the one people call the model by: ``preheat serve NAME`` finds the entry, and the
server answers to that name, its cache key staying an alias; a model it does not serve is OpenAI's 404."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.core.errors import ConfigError
from preheat.router.cluster import ServerProcess
from preheat.server.settings import ServeSettings
from preheat.store.cache import META_NAME, EntryMeta, ModelCache, resolve_model, source_name
from preheat.testing.synthetic import make_tiny_servable_model
from serving import Client

KEY = "xxh3-128-0123456789abcdef0123456789abcdef"


def publish(cache: ModelCache, model: Path, key: str, uri: str, name: str | None = None) -> str:
    """``model``'s files as the published entry ``key`` of ``cache``, as a pull leaves one."""
    cache.ensure_dirs()
    shutil.copytree(model, cache.partial_dir(key))
    return cache.publish(key, uri, name=name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_servable_model(tmp_path_factory.mktemp("servable"))


def test_an_entry_is_named_for_its_source_unless_told(tmp_path: Path, tiny: Path) -> None:
    cache = ModelCache(tmp_path)
    pulled = publish(cache, tiny, KEY, "https://models.internal/org/llama-3-8b/")
    told = publish(cache, tiny, "demo-key", "file:///w/SmolLM2-135M-Instruct.Q4_1.gguf", name="smollm2-135m-instruct")
    names = [meta.name for meta in (EntryMeta.read(pulled), EntryMeta.read(told)) if meta is not None]
    assert names == ["llama-3-8b", "smollm2-135m-instruct"]
    assert {e.key: e.name for e in cache.entries()} == {KEY: "llama-3-8b", "demo-key": "smollm2-135m-instruct"}
    assert source_name("file:///w/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert source_name("s3://models/qwen2") == "qwen2"
    assert source_name("preheat://smollm2") == "smollm2"
    assert source_name("https://files.internal") == ""


def test_an_entry_published_before_names_is_named_for_its_uri_and_can_be_named(tmp_path: Path, tiny: Path) -> None:
    cache = ModelCache(tmp_path)
    path = publish(cache, tiny, KEY, "https://models.internal/llama/")
    meta_path = os.path.join(path, META_NAME)
    record = json.loads(Path(meta_path).read_text())
    del record["name"]  # what every entry looked like before
    Path(meta_path).write_text(json.dumps(record))
    assert EntryMeta.read(path).name == "llama"  # type: ignore[union-attr]
    cache.name_entry(KEY, "llama-3")
    assert EntryMeta.read(path).name == "llama-3"  # type: ignore[union-attr]
    assert cache.lookup(KEY) == path  # still published


def test_serve_takes_the_newest_entry_of_a_name(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ModelCache(tmp_path / "cache")
    publish(cache, tiny, "older", "s3://models/tiny")
    newer = publish(cache, tiny, "newer", "https://mirror.internal/tiny/")
    monkeypatch.chdir(tmp_path)  # no ./tiny here
    settings = ServeSettings.resolve({"model": "tiny"}, {"PREHEAT_CACHE_DIR": str(cache.root)})
    assert settings.model == newer
    assert settings.served_names == ("tiny", "newer")
    assert settings.model_name == "tiny"
    assert resolve_model("tiny", cache.root) == newer


def test_a_local_directory_wins_over_an_entry_of_the_same_name(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ModelCache(tmp_path / "cache")
    publish(cache, tiny, KEY, "s3://models/tiny")
    shutil.copytree(tiny, tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    settings = ServeSettings.resolve({"model": "tiny"}, {"PREHEAT_CACHE_DIR": str(cache.root)})
    assert (settings.model, settings.served_names) == ("tiny", ("tiny",))


def test_an_unknown_name_names_the_cache_it_looked_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"nor the name of an entry of the node cache in {tmp_path}.*cache ls"):
        ServeSettings.resolve({"model": "nothing-by-this-name"}, {"PREHEAT_CACHE_DIR": str(tmp_path)})


def test_a_served_model_name_is_the_only_name(tmp_path: Path, tiny: Path) -> None:
    path = publish(ModelCache(tmp_path), tiny, KEY, "s3://models/tiny")
    settings = ServeSettings.resolve({"model": path, "served_model_name": "policy"}, {})
    assert settings.served_names == ("policy",)


@pytest.fixture(scope="module")
def entry_server(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[ServerProcess]:
    """``preheat serve`` of a node-cache entry's directory, the path the demo prints."""
    path = publish(ModelCache(tmp_path_factory.mktemp("cache")), tiny, KEY, "https://models.internal/tiny-llama/")
    with ServerProcess(path) as server:
        server.wait_ready(timeout=120)
        yield server


def test_an_entry_is_served_under_its_name_with_its_key_as_an_alias(entry_server: ServerProcess) -> None:
    client = Client(entry_server.url)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-llama"]
    for model in ("tiny-llama", KEY):
        reply = client.post("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})
        assert reply.status == 200, reply.body
        assert reply.json()["model"] == model
    unknown = client.post("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]})
    assert unknown.status == 404
    error = unknown.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "'tiny-llama'" in error["message"]
