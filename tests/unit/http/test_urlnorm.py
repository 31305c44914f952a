"""URL normal forms (preheat.http.urlnorm) and the ``--allow-model`` rule built on them (preheat.server.allow): the
form is stable, and a URL the rule lets through under ``ORIGIN/public/*`` names something under ``/public/`` at any
origin, even one that decodes (twice), takes ``\\`` for ``/`` and resolves ``..``."""

from __future__ import annotations

import posixpath
import re
from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.core.errors import ConfigError
from preheat.http.urlnorm import normalize_url, remove_dot_segments
from preheat.server.allow import normalize, refusal
from strategies import FUZZ

PREFIX = "http://origin.internal/public"
PATTERNS = [f"{PREFIX}/*"]

# Pieces of a path, hostile ones included: dots plain and escaped, escaped separators and percent signs, malformed
# escapes, unreserved characters escaped, non-ASCII, empty segments.
PIECES = st.sampled_from([
    "a", "B", "tiny", "~u", "-", "_", ".", "..", "%2e", "%2E", "%2e%2e", ".%2e", "%2F", "%2f", "%5c", "%5C", "\\",
    "%25", "%252e", "%252e%252e", "%2e%2e%2f", "..%5c", "%00", "%0a", "%", "%4", "%zz", "%41", "%7e", "%7E", "%20",
    "%C3%A9", "é", "%ff", "%3F", "%23", ";", "=", "@", ":", "*", "",
])  # fmt: skip
paths = st.lists(st.lists(PIECES, max_size=4).map("".join), max_size=6).map("/".join)
hosts = st.sampled_from(["origin.internal", "ORIGIN.internal", "Origin.Internal", "10.0.0.7", "[::1]", "[FD00::A]"])
ports = st.sampled_from(["", ":80", ":0080", ":443", ":8080", ":", ":65536", ":x"])
schemes = st.sampled_from(["http", "HTTP", "https", "HtTpS"])
urls = st.builds(lambda s, h, p, path: f"{s}://{h}{p}/{path}", schemes, hosts, ports, paths)


def origin_view(url: str) -> str:
    """The path a lenient origin serves for ``url``: decoded until nothing changes (an origin that decodes twice, or
    more), ``\\`` taken for ``/``, dot segments resolved."""
    path = url.split("://", 1)[1].partition("/")[2]
    path = "/" + path
    while (decoded := unquote(path)) != path:
        path = decoded
    return posixpath.normpath("/" + path.replace("\\", "/").lstrip("/"))


@FUZZ
@given(urls)
def test_the_normal_form_is_a_fixed_point(url: str) -> None:
    try:
        once = normalize_url(url)
    except ConfigError:
        return
    assert normalize_url(once) == once
    assert re.fullmatch(r"https?://[^/A-Z]+(/.*)?", once), once  # lower-case scheme and host
    assert not re.search(r"%[0-9a-f]?[a-f]", once)  # escapes in upper case
    assert not {".", ".."} & set(once.split("/")[3:])  # no dot segments


@FUZZ
@given(paths)
def test_an_allowed_model_never_names_anything_outside_its_prefix_at_any_origin(path: str) -> None:
    model = f"{PREFIX}/{path}"
    if refusal(model, PATTERNS) is not None:
        return
    fetched = normalize(model)  # what the replica loads once the rule said yes
    assert fetched.startswith(PREFIX + "/")
    assert fetched == normalize(fetched)
    assert (origin_view(fetched) + "/").startswith("/public/"), (model, fetched, origin_view(fetched))


@FUZZ
@given(paths)
def test_dot_segment_removal_never_climbs_above_the_root(path: str) -> None:
    removed = remove_dot_segments("/" + path)
    assert removed.startswith("/")
    assert not {".", ".."} & set(removed.split("/"))
    assert remove_dot_segments(removed) == removed


@pytest.mark.parametrize(
    ("url", "normal"),
    [
        ("HTTP://Origin.Internal:80/public/tiny", "http://origin.internal/public/tiny"),
        ("https://origin.internal:443/a", "https://origin.internal/a"),
        ("https://origin.internal:8443/a", "https://origin.internal:8443/a"),
        ("http://origin.internal:/a", "http://origin.internal/a"),
        ("http://[FD00::A]:80/a", "http://[fd00::a]/a"),
        ("http://origin.internal/%7euser/%41%42%2d", "http://origin.internal/~user/AB-"),
        ("http://origin.internal/a%20b/%c3%a9", "http://origin.internal/a%20b/%C3%A9"),
        ("http://origin.internal/a/./b/../c", "http://origin.internal/a/c"),
        ("http://origin.internal/a/%2e%2E/c", "http://origin.internal/c"),
        ("http://origin.internal/../../etc", "http://origin.internal/etc"),
        ("http://origin.internal", "http://origin.internal"),
    ],
)
def test_urls_in_their_normal_form(url: str, normal: str) -> None:
    assert normalize_url(url) == normal


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://origin.internal/a%2fb", "escaped '/'"),
        ("http://origin.internal/a%5Cb", "escaped '\\\\'"),
        ("http://origin.internal/a\\b", "'\\\\'"),
        ("http://origin.internal/%252e%252e/x", "escaped '%'"),
        ("http://origin.internal/a%00", "NUL"),
        ("http://origin.internal/a%0d%0aX: y", "control"),
        ("http://origin.internal/a%zz", "starts no escape"),
        ("http://origin.internal/a%ff", "UTF-8"),
        ("http://user:pw@origin.internal/a", "user info"),
        ("http://orig%69n.internal/a", "escaped host"),
        ("http://origin.internal:99999/a", "1-65535"),
        ("http://ori gin/a", "host"),
        ("http://origin.internal/a?x=1", "query"),
        ("ftp://origin.internal/a", "not an http"),
    ],
)
def test_urls_without_a_normal_form_are_refused_saying_why(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says) if "\\" not in says else says):
        normalize_url(url)


@pytest.mark.parametrize(
    "model",
    [
        f"{PREFIX}/%2e%2e/private/tinyc",  # the finding: an origin that resolves it serves /private/tinyc
        f"{PREFIX}/%2E%2E/private/tinyc",
        f"{PREFIX}/.%2e/private/tinyc",
        f"{PREFIX}/%2e%2e%2fprivate/tinyc",
        f"{PREFIX}/%252e%252e/private/tinyc",
        f"{PREFIX}/..%5cprivate",
        f"{PREFIX}/x%00",
        f"{PREFIX}/../private",
        "http://origin.internal/private/tinyc",
        "http://origin.internal.evil.example/public/x",
        "http://origin.internal:8080/public/x",  # another port is another origin
    ],
)
def test_allow_model_refuses_what_would_name_something_else(model: str) -> None:
    assert refusal(model, PATTERNS) is not None


def test_allow_model_compares_and_loads_normal_forms_on_both_sides() -> None:
    assert refusal("HTTP://ORIGIN.INTERNAL:80/public/%74iny", PATTERNS) is None
    assert normalize("HTTP://ORIGIN.INTERNAL:80/public/%74iny") == f"{PREFIX}/tiny"
    assert refusal(f"{PREFIX}/tiny", ["http://Origin.Internal:80/%70ublic/*"]) is None  # the pattern is normalized
    assert refusal(f"{PREFIX}/tiny", ["http://origin.internal/public/t?ny"]) is None  # its globs kept
    assert refusal("s3://models/team/llama", ["s3://models/*"]) is None
    assert normalize("S3://models/team/llama") == "s3://models/team/llama"


def test_s3_keys_are_literal_so_escapes_in_them_are_refused() -> None:
    # S3 reads "%2e%2e" as four characters; an S3-compatible server that decodes it would read "..".
    assert refusal("s3://models/public/%2e%2e/private", ["s3://models/public/*"]) is not None
    assert refusal("s3://models/public/../private", ["s3://models/public/*"]) is not None
