"""Which replicas a Kubernetes Service has, from its EndpointSlices (pure: JSON in, replica URLs out).

``--replicas-from k8s://NAMESPACE/SERVICE[?port=NAME]`` names the Service; its EndpointSlices (label
``kubernetes.io/service-name=SERVICE``) list the pods behind it. An endpoint whose ``conditions.ready`` is true (or
absent, which the API defines as ready) is a replica at ``http://ADDRESS:PORT``; a not-ready or terminating one is
not. The I/O (list, watch, reconnect) is ``k8s_discovery.py``; this module takes the objects exactly as the API
server sends them (camelCase JSON) and never talks to it.

    >>> ref = parse_k8s_url("k8s://llm/preheat-replicas?port=http")
    >>> ref.namespace, ref.service, ref.port, ref.label_selector
    ('llm', 'preheat-replicas', 'http', 'kubernetes.io/service-name=preheat-replicas')
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from preheat.core.errors import ConfigError, RouterError

SCHEME = "k8s"
SERVICE_LABEL = "kubernetes.io/service-name"
# RFC 1123 labels (namespace, port names) and DNS-1035 labels (Service names): what the API server accepts.
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class ServiceRef:
    """The Service whose ready endpoints are the replicas, and which of its ports they serve on (None: its only)."""

    namespace: str
    service: str
    port: str | None = None

    @property
    def label_selector(self) -> str:
        return f"{SERVICE_LABEL}={self.service}"

    def __str__(self) -> str:
        return f"{SCHEME}://{self.namespace}/{self.service}" + (f"?port={self.port}" if self.port else "")


def parse_k8s_url(url: str) -> ServiceRef:
    """``k8s://NAMESPACE/SERVICE[?port=NAME]``; ``ConfigError`` naming ``url`` for anything else."""
    parts = urlsplit(url.strip())
    path = parts.path.strip("/")
    query = parse_qs(parts.query, keep_blank_values=True)
    usage = f"--replicas-from {url!r}: give it as {SCHEME}://NAMESPACE/SERVICE[?port=NAME]"
    if parts.scheme != SCHEME or not parts.netloc or "/" in path or not path or parts.fragment:
        raise ConfigError(usage)
    if set(query) - {"port"} or len(query.get("port", [])) > 1:
        raise ConfigError(f"{usage} (the only option is port=)")
    port = query["port"][0] if "port" in query else None
    for what, value in (("namespace", parts.netloc), ("service", path), ("port name", port)):
        if value is not None and not NAME.match(value):
            raise ConfigError(f"{usage}: {what} {value!r} is not a Kubernetes name (lower-case letters, digits, '-')")
    return ServiceRef(parts.netloc, path, port)


def _port(slice_: Mapping[str, object], port_name: str | None, where: str) -> int | None:
    """The slice's port the replicas serve on; None when it has none (a Service without ports, or not that one)."""
    ports = [p for p in _list(slice_.get("ports")) if p.get("protocol", "TCP") == "TCP" and p.get("port")]
    if port_name is not None:
        ports = [p for p in ports if p.get("name") == port_name]
    if len(ports) > 1:
        names = ", ".join(repr(p.get("name", "")) for p in ports)
        raise RouterError(f"{where} has ports {names}: choose one with ?port=NAME in --replicas-from")
    if not ports:
        return None
    number = ports[0]["port"]
    return number if isinstance(number, int) and 0 < number < 65536 else None


def _list(value: object) -> list[Mapping[str, object]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def ready(endpoint: Mapping[str, object]) -> bool:
    """Whether an endpoint takes traffic: ``conditions.ready`` true, or absent ("unknown state ... interpreted as
    ready", the EndpointSlice API); a terminating endpoint always has it false."""
    conditions = endpoint.get("conditions")
    return not (isinstance(conditions, Mapping) and conditions.get("ready") is False)


def host_url(address: str, port: int) -> str:
    """``http://ADDRESS:PORT``, with an IPv6 address in brackets."""
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def slice_urls(slice_: Mapping[str, object], port_name: str | None = None) -> frozenset[str]:
    """The replica URLs one EndpointSlice holds: each ready endpoint's addresses on the chosen port.

    >>> s = {"metadata": {"name": "r-abc"}, "addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
    ...      "endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": True}},
    ...                    {"addresses": ["10.0.0.6"], "conditions": {"ready": False, "terminating": True}}]}
    >>> sorted(slice_urls(s))
    ['http://10.0.0.5:8000']
    """
    where = f"EndpointSlice {_name(slice_)!r}"
    port = _port(slice_, port_name, where)
    if port is None:
        return frozenset()
    urls: set[str] = set()
    for endpoint in _list(slice_.get("endpoints")):
        if not ready(endpoint):
            continue
        addresses = endpoint.get("addresses")
        for address in addresses if isinstance(addresses, list) else []:
            if isinstance(address, str) and address:
                urls.add(host_url(address, port))
    return frozenset(urls)


def _name(obj: Mapping[str, object]) -> str:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return name if isinstance(name, str) else ""


def resource_version(obj: Mapping[str, object]) -> str | None:
    """``metadata.resourceVersion`` of a list, an object or a BOOKMARK's object (None when absent)."""
    metadata = obj.get("metadata")
    version = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
    return version if isinstance(version, str) and version else None


@dataclass
class SliceSet:
    """The Service's slices as last seen, by name; ``urls()`` is the replica set (a pod can sit in two slices for a
    moment while the controller moves it: the union counts it once).

    >>> slices = SliceSet(port=None)
    >>> one = {"metadata": {"name": "a"}, "ports": [{"port": 80}], "endpoints": [{"addresses": ["10.0.0.1"]}]}
    >>> slices.apply("ADDED", one)
    True
    >>> slices.apply("DELETED", one), slices.urls()
    (True, frozenset())
    """

    port: str | None
    _slices: dict[str, frozenset[str]] = field(default_factory=dict)
    # Per slice, why it counts for no replica (ports to choose from): the watcher logs it once.
    problems: dict[str, str] = field(default_factory=dict)

    def urls(self) -> frozenset[str]:
        return frozenset().union(*self._slices.values())

    def reset(self, items: Iterable[Mapping[str, object]]) -> bool:
        """Replace everything with a fresh list's items; True when the replica set changed."""
        before = self.urls()
        self.problems.clear()
        self._slices = {_name(item): self._urls(item) for item in items}
        return self.urls() != before

    def apply(self, kind: str, obj: Mapping[str, object]) -> bool:
        """Fold one watch event in (``ADDED``, ``MODIFIED``, ``DELETED``; others change nothing); True when the
        replica set changed."""
        before = self.urls()
        name = _name(obj)
        if kind in ("ADDED", "MODIFIED"):
            self._slices[name] = self._urls(obj)
        elif kind == "DELETED":
            self._slices.pop(name, None)
            self.problems.pop(name, None)
        return self.urls() != before

    def _urls(self, obj: Mapping[str, object]) -> frozenset[str]:
        self.problems.pop(_name(obj), None)
        try:
            return slice_urls(obj, self.port)
        except RouterError as exc:
            self.problems[_name(obj)] = str(exc)
            return frozenset()
