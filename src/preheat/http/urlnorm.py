"""One normal form for an ``http(s)://`` URL (RFC 3986 section 6.2.2), pure: what a rule that matches URLs compares,
and what the caller then fetches, so that the URL matched and the URL fetched are the same string.

The normal form: scheme and host in lower case, no default port (``:80`` for http, ``:443`` for https),
percent-escapes of unreserved characters (``%41`` for ``A``, ``%2e`` for ``.``) decoded and every other escape in
upper case, and no ``.`` or ``..`` path segments (section 5.2.4). What no normal form can stand for is refused with
a ``ConfigError`` naming the URL: an escaped ``/`` or ``\\`` (a server that decodes before it splits the path sees
other segments than the URL shows), an escaped ``%`` (a server that decodes twice sees another path), an escaped NUL
or control character, a malformed escape, escapes that are not UTF-8, and a host that is not plain ASCII letters,
digits, dots, dashes or an IP literal.

>>> normalize_url("HTTP://Models.Internal:80/public/%7Euser/%2e%2e/tiny")
'http://models.internal/public/tiny'
>>> normalize_url("https://models.internal/a%2fb")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
preheat.core.errors.ConfigError: https://models.internal/a%2fb: an escaped '/' has no normal form ...
"""

from __future__ import annotations

import re
import string
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from preheat.core.errors import ConfigError

SCHEMES = ("http", "https")
DEFAULT_PORTS = {"http": 80, "https": 443}
UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
# pchar (RFC 3986 section 3.3) without the escapes, plus "/": what a normal path carries unescaped.
PATH_SAFE = "/!$&'()*+,;=:@-._~"
_ESCAPE = re.compile(r"%(?P<hex>[0-9A-Fa-f]{2})?")
# Escapes whose decoding changes how a server splits or reads the path: refused, never decoded.
AMBIGUOUS = {
    "2F": "an escaped '/' has no normal form (a server that decodes before it splits the path would see other "
    "segments)",
    "5C": "an escaped '\\' has no normal form (some servers take it for '/')",
    "25": "an escaped '%' has no normal form (a server that decodes twice would see another path)",
}
_HOST = re.compile(r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?\.?$|^\[[0-9a-f:.]+\]$")


def decode_path(path: str, where: str) -> str:
    """``path`` with every percent-escape decoded, once; ``ConfigError`` naming ``where`` for an escape no normal
    form can stand for (``AMBIGUOUS``, NUL and control characters, a malformed escape, bytes that are not UTF-8) and
    for a raw backslash.

    >>> decode_path("/a%20b/%7Ec", "u")
    '/a b/~c'
    """
    if "\\" in path:
        raise ConfigError(f"{where}: a '\\' in a URL path has no normal form (some servers take it for '/')")
    for escape in _ESCAPE.finditer(path):
        code = escape.group("hex")
        if code is None:
            raise ConfigError(f"{where}: a '%' that starts no escape (%XX) is not a URL")
        code = code.upper()
        if code in AMBIGUOUS:
            raise ConfigError(f"{where}: {AMBIGUOUS[code]}; write the path without it")
    try:
        decoded = unquote(path, errors="strict")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: its percent-escapes are not UTF-8 text") from None
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in decoded):
        raise ConfigError(f"{where}: its path holds a NUL or control character (escaped)")
    return decoded


def encode_path(decoded: str, *, keep: str = "") -> str:
    """The normal spelling of a decoded path: unreserved characters and sub-delimiters as they are, everything else
    escaped (UTF-8, upper-case hex). ``keep``: more characters to leave unescaped (a glob pattern's ``*?[]``)."""
    return quote(decoded, safe=PATH_SAFE + keep)


def remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4 on an absolute path (or an empty one): ``.`` segments dropped, each ``..`` with the
    segment before it (never above the root).

    >>> remove_dot_segments("/a/b/../c/./d/..")
    '/a/c/'
    >>> remove_dot_segments("/../../etc")
    '/etc'
    """
    if not path:
        return path
    segments = path.split("/")
    out: list[str] = []
    for segment in segments[1:]:
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
    if segments[-1] in (".", ".."):
        out.append("")  # "/a/b/.." names the directory "/a/": the trailing slash stays
    return "/" + "/".join(out)


def normalize_authority(scheme: str, netloc: str, where: str) -> str:
    """``host[:port]`` in lower case, without the scheme's default port; ``ConfigError`` naming ``where`` for user
    info, escapes, a malformed port or a host that is not ASCII letters, digits, dots and dashes or an IP literal.

    >>> normalize_authority("https", "Models.Internal:443", "u"), normalize_authority("http", "[::1]:8080", "u")
    ('models.internal', '[::1]:8080')
    """
    if "@" in netloc:
        raise ConfigError(f"{where}: user info (user:pass@) in a URL is not allowed")
    if "%" in netloc:
        raise ConfigError(f"{where}: an escaped host has no normal form")
    port_text: str | None
    if netloc.startswith("["):  # an IPv6 literal: its colons are not the port's
        end = netloc.find("]") + 1
        host, rest = (netloc[:end], netloc[end:]) if end else (netloc, "")
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{where}: {netloc!r} is not host[:port]")
        port_text = rest[1:] if rest else None
    else:
        host, colon, after = netloc.partition(":")
        port_text = after if colon else None
    host = host.lower()
    if not _HOST.match(host):
        raise ConfigError(
            f"{where}: host {host!r} is not ASCII letters, digits, dots and dashes or an IP literal (write an "
            "internationalised name in its xn-- form)"
        )
    if port_text is None or port_text == "":  # "host:" is "host" (RFC 3986 section 6.2.3)
        return host
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{where}: port {port_text!r} is not 1-65535")
    port = int(port_text)
    return host if DEFAULT_PORTS.get(scheme) == port else f"{host}:{port}"


def normalize_url(url: str) -> str:
    """The normal form of an ``http(s)://`` URL without query or fragment (see the module's docstring); applying it
    twice changes nothing. ``ConfigError`` naming ``url`` when there is none."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or not parts.netloc:
        raise ConfigError(f"{url}: not an http(s) URL (expected http://host[:port]/path)")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ConfigError(f"{url}: a query or fragment has no place here")
    authority = normalize_authority(scheme, parts.netloc, url)
    path = encode_path(remove_dot_segments(decode_path(parts.path, url)))
    return urlunsplit((scheme, authority, path, "", ""))


def has_dot_segments(path: str) -> bool:
    """Whether a decoded path has a ``.`` or ``..`` segment (``%2e%2e`` counts once decoded)."""
    return any(segment in (".", "..") for segment in path.split("/"))
