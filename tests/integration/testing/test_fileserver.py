"""``FileServer``: correct Range answers, tokens, no byte from outside its root, and faults that do what they say."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.core.errors import ConfigError, ForbiddenPathError, UnsatisfiableRangeError
from preheat.http.ranges import parse_range
from preheat.testing.fileserver import Faults, FileServer, resolve_path

DATA = bytes(range(256)) * 40  # 10240 bytes, every offset recognisable
SECRET = b"outside-the-root: must never be served"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``root/`` with ``data.bin``, ``sub/inner.bin``, a symlink inside and one escaping; ``secret.txt`` beside it."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "data.bin").write_bytes(DATA)
    (root / "sub" / "inner.bin").write_bytes(b"inner")
    (tmp_path / "secret.txt").write_bytes(SECRET)
    os.symlink(root / "data.bin", root / "alias.bin")
    os.symlink(tmp_path / "secret.txt", root / "escape.txt")
    os.symlink(tmp_path, root / "escape-dir")
    return root


@pytest.fixture
def server(tree: Path) -> Iterator[FileServer]:
    with FileServer(tree) as running:
        yield running


def request(
    server: FileServer, path: str, headers: Mapping[str, str] | None = None, method: str = "GET"
) -> tuple[int, http.client.HTTPResponse, bytes]:
    """Send ``path`` exactly as written (no normalisation) and return status, response and body."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        try:
            body = response.read()
        except http.client.IncompleteRead as exc:
            body = exc.partial
        return response.status, response, body
    finally:
        conn.close()


# -- ranges -----------------------------------------------------------------------------------------------------------


def test_whole_file_is_200_with_length(server: FileServer) -> None:
    status, response, body = request(server, "/data.bin")
    assert (status, body) == (200, DATA)
    assert response.getheader("Content-Length") == str(len(DATA))
    assert response.getheader("Accept-Ranges") == "bytes"


@pytest.mark.parametrize(
    ("spec", "first", "last"),
    [("bytes=0-0", 0, 0), ("bytes=100-199", 100, 199), ("bytes=10000-", 10000, 10239), ("bytes=-40", 10200, 10239),
     ("bytes=10200-99999", 10200, 10239)],
)  # fmt: skip
def test_range_is_206_with_content_range(server: FileServer, spec: str, first: int, last: int) -> None:
    status, response, body = request(server, "/data.bin", {"Range": spec})
    assert status == 206
    assert response.getheader("Content-Range") == f"bytes {first}-{last}/{len(DATA)}"
    assert body == DATA[first : last + 1]


@pytest.mark.parametrize("spec", ["bytes=10240-", "bytes=99999-100000", "bytes=-0"])
def test_range_past_the_end_is_416(server: FileServer, spec: str) -> None:
    status, response, body = request(server, "/data.bin", {"Range": spec})
    assert status == 416
    assert response.getheader("Content-Range") == f"bytes */{len(DATA)}"
    assert body == b""


@pytest.mark.parametrize("spec", ["bytes=0-1,5-6", "lines=0-1", "bytes=5-2", "bytes=x-y"])
def test_unsupported_or_malformed_range_gets_the_whole_file(server: FileServer, spec: str) -> None:
    status, _, body = request(server, "/data.bin", {"Range": spec})
    assert (status, body) == (200, DATA)


def test_head_has_the_length_and_no_body(server: FileServer) -> None:
    status, response, body = request(server, "/data.bin", method="HEAD")
    assert (status, body) == (200, b"")
    assert response.getheader("Content-Length") == str(len(DATA))


def test_missing_file_and_directory_are_404(server: FileServer) -> None:
    assert request(server, "/nope.bin")[0] == 404
    assert request(server, "/sub")[0] == 404
    assert request(server, "/sub/inner.bin")[2] == b"inner"


def test_keep_alive_serves_several_requests_on_one_connection(server: FileServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for first in (0, 500, 9000):
        conn.request("GET", "/data.bin", headers={"Range": f"bytes={first}-{first + 99}"})
        assert conn.getresponse().read() == DATA[first : first + 100]
    conn.close()
    assert server.stats.snapshot().statuses == {206: 3}


@given(st.integers(0, 5000), st.integers(0, 6000), st.integers(0, 6000))
def test_parse_range_stays_inside_the_file(size: int, first: int, last: int) -> None:
    try:
        span = parse_range(f"bytes={first}-{last}", size)
    except UnsatisfiableRangeError:
        assert first >= size
        return
    if last < first:
        assert span is None
        return
    assert span == (first, min(last, size - 1))
    assert 0 <= span[0] <= span[1] < size


@given(st.integers(0, 5000), st.integers(1, 6000))
def test_parse_suffix_range_is_the_tail(size: int, suffix: int) -> None:
    if size == 0:
        with pytest.raises(UnsatisfiableRangeError):
            parse_range(f"bytes=-{suffix}", size)
        return
    assert parse_range(f"bytes=-{suffix}", size) == (max(0, size - suffix), size - 1)


# -- the root is a wall -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/../secret.txt", "/%2e%2e/secret.txt", "/sub/../../secret.txt", "/sub/%2E%2E/%2e%2e/secret.txt",
     "/..%2fsecret.txt", "/escape.txt", "/escape-dir/secret.txt", "/sub\\..\\..\\secret.txt", "/data.bin%00.txt"],
)  # fmt: skip
def test_paths_outside_the_root_are_refused(server: FileServer, path: str) -> None:
    status, _, body = request(server, path)
    assert status in (403, 404)
    assert SECRET not in body


def test_absolute_looking_paths_stay_inside_the_root(server: FileServer, tmp_path: Path) -> None:
    status, _, body = request(server, "/" + str(tmp_path / "secret.txt"))
    assert status == 404
    assert SECRET not in body
    assert request(server, "//data.bin")[2] == DATA


def test_symlink_inside_the_root_is_served(server: FileServer) -> None:
    assert request(server, "/alias.bin")[2] == DATA


def test_resolve_path_refuses_escapes(tree: Path) -> None:
    root = os.path.realpath(tree)
    assert resolve_path(root, "/sub/inner.bin") == os.path.join(root, "sub", "inner.bin")
    for escape in ("/../x", "/escape.txt", "/a/%2e%2e/%2e%2e/x"):
        with pytest.raises(ForbiddenPathError):
            resolve_path(root, escape)


def test_dot_files_and_dot_directories_are_never_served(tree: Path, server: FileServer) -> None:
    (tree / ".env").write_bytes(b"API_KEY=never-served")
    (tree / ".git").mkdir()
    (tree / ".git" / "config").write_bytes(b"[remote] never-served")
    (tree / "sub" / ".journal").write_bytes(b"never-served")
    os.symlink(tree / ".env", tree / "env-link")  # a visible name leading to a hidden file
    for path in ("/.env", "/%2eenv", "/.git/config", "/sub/.journal", "/env-link", "/sub/../.env", "/./.env"):
        status, _, body = request(server, path)
        assert status in (403, 404), path  # 404 for the hidden, 403 for "..": neither says whether it exists
        assert b"never-served" not in body, path
    assert request(server, "/.env")[0] == 404
    assert request(server, "/.env", method="HEAD")[0] == 404
    assert request(server, "/sub/inner.bin")[2] == b"inner"  # beside them, the rest is served


def test_a_lenient_origin_resolves_dot_segments_inside_its_root_only(tree: Path) -> None:
    (tree / "public").mkdir()
    with FileServer(tree, faults=Faults(resolve_dot_segments=True)) as lenient:
        assert request(lenient, "/public/%2e%2e/sub/inner.bin")[2] == b"inner"  # what an allow-list must not miss
        assert request(lenient, "/public/../data.bin")[2] == DATA
        status, _, body = request(lenient, "/%2e%2e/%2e%2e/secret.txt")  # never above the root: /secret.txt
        assert status == 404
        assert SECRET not in body
        assert request(lenient, "/public/%2e%2e/.env")[0] == 404
        assert lenient.stats.snapshot().targets[:2] == ("/public/%2e%2e/sub/inner.bin", "/public/../data.bin")


# -- token ------------------------------------------------------------------------------------------------------------


def test_token_missing_is_401_wrong_is_403_right_is_200(tree: Path) -> None:
    with FileServer(tree, token="s3cret") as server:
        status, response, _ = request(server, "/data.bin")
        assert status == 401
        assert response.getheader("WWW-Authenticate", "").startswith("Bearer")
        assert request(server, "/data.bin", {"Authorization": "Bearer nope"})[0] == 403
        assert request(server, "/data.bin", {"Authorization": "Bearer s3cret"})[2] == DATA


# -- throttle and faults ----------------------------------------------------------------------------------------------


def test_throttled_server_sends_the_same_bytes(tree: Path) -> None:
    with FileServer(tree, throttle_bps=10_000_000) as server:
        assert request(server, "/data.bin", {"Range": "bytes=7-9000"})[2] == DATA[7:9001]


def test_drop_cuts_the_body_once(server: FileServer) -> None:
    server.faults.drop_after_bytes = 1000
    assert request(server, "/data.bin")[2] == DATA[:1000]
    assert request(server, "/data.bin")[2] == DATA
    assert server.stats.snapshot().drops == 1


def test_short_responses_are_not_cut(server: FileServer) -> None:
    server.faults.drop_after_bytes, server.faults.drop_times = 1000, None
    assert request(server, "/data.bin", {"Range": "bytes=0-999"})[2] == DATA[:1000]
    assert server.stats.snapshot().drops == 0


def test_corrupt_flips_exactly_the_chosen_bytes(server: FileServer) -> None:
    server.faults.corrupt_offsets = frozenset({5, 300})
    body = request(server, "/data.bin", {"Range": "bytes=0-999"})[2]
    flipped = [i for i, (a, b) in enumerate(zip(body, DATA[:1000], strict=True)) if a != b]
    assert flipped == [5, 300]
    assert body[5] == DATA[5] ^ 0xFF


def test_ignore_range_answers_200_with_everything(server: FileServer) -> None:
    server.faults.ignore_range = True
    status, response, body = request(server, "/data.bin", {"Range": "bytes=0-9"})
    assert (status, body) == (200, DATA)
    assert response.getheader("Accept-Ranges") is None


def test_shift_range_answers_another_range_and_says_so(server: FileServer) -> None:
    server.faults.shift_range = 3
    status, response, body = request(server, "/data.bin", {"Range": "bytes=0-9"})
    assert status == 206
    assert response.getheader("Content-Range") == f"bytes 3-12/{len(DATA)}"
    assert body == DATA[3:13]


def test_fail_status_fails_the_next_requests_only(server: FileServer) -> None:
    server.faults.fail_status, server.faults.fail_times = 503, 2
    assert [request(server, "/data.bin")[0] for _ in range(3)] == [503, 503, 200]


def test_server_refuses_a_missing_root(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        FileServer(tmp_path / "nothing")


def test_faults_are_off_by_default() -> None:
    assert Faults() == Faults(ignore_range=False, drop_after_bytes=None, shift_range=0, fail_status=None, stall=False)


# -- command line -----------------------------------------------------------------------------------------------------


def test_command_line_serves_a_directory(tree: Path) -> None:
    command = [sys.executable, "-m", "preheat.testing.fileserver", str(tree), "--port", "0", "--throttle", "50MB"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line.startswith("serving ")
            url = line.split(" at ")[1].split()[0]
            host, port = url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("GET", "/data.bin", headers={"Range": "bytes=1-4"})
            assert conn.getresponse().read() == DATA[1:5]
            conn.close()
        finally:
            process.terminate()
