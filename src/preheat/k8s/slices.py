"""Which replicas a Kubernetes Service has, from its EndpointSlices (pure: JSON in, replica URLs out).

``--replicas-from k8s://NAMESPACE/SERVICE[?port=NAME]`` names the Service; its EndpointSlices (label
``kubernetes.io/service-name=SERVICE``) list the pods behind it. An endpoint whose ``conditions.ready`` is true (or
absent, which the API defines as ready) is a replica at ``http://ADDRESS:PORT``; a not-ready or terminating one is
not. The I/O (list, watch, reconnect) is ``k8s/discovery.py``; this module takes the objects exactly as the API
server sends them (camelCase JSON) and never talks to it.

Every replica receives prompts and the replica key, so a slice is trusted only as far as the cluster vouches for it
(``SliceRules``; docs/security.md, *Discovery*):

- only slices the endpoint-slice controller manages (label ``endpointslice.kubernetes.io/managed-by:
  endpointslice-controller.k8s.io``; asked for in the label selector too), not one anybody with write access to
  EndpointSlices made by hand;
- addresses are IP literals (an ``FQDN`` slice counts for nothing: a name would send prompts wherever DNS says);
  only an endpoint's first address (the API lets a consumer take only that one); never an unspecified, multicast,
  loopback or link-local address (``169.254.169.254`` is the cloud's metadata service), unless a ``--pod-cidr``
  that lies inside that range itself names it (``127.0.0.0/8`` for tests; ``0.0.0.0/0`` does not let them in);
- with ``--pod-cidr`` given, only addresses inside one of them;
- at most ``max_slice_endpoints`` endpoints in a slice (the API server's own limit is 1,000; a bigger slice is
  forged and refused whole) and ``max_replicas`` replicas in all: past that, the replicas already known stay and
  new ones wait for room (a flood cannot push honest replicas out).

What is refused is said once per slice (``SliceSet.problems``), never silently dropped.

    >>> ref = parse_k8s_url("k8s://llm/preheat-replicas?port=http")
    >>> ref.namespace, ref.service, ref.port, ref.label_selector.split(",")
    ('llm', 'preheat-replicas', 'http', ['kubernetes.io/service-name=preheat-replicas', \
'endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io'])
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from preheat.core.errors import ConfigError, RouterError

SCHEME = "k8s"
SERVICE_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
CONTROLLER = "endpointslice-controller.k8s.io"  # the value kube-controller-manager's slice controller sets
MAX_SLICE_ENDPOINTS = 1000  # the API server refuses a slice with more (EndpointSlice validation)
MAX_REPLICAS = 1000  # replicas one router follows from a Service; each is health-checked every interval
ADDRESS_TYPES = {"IPv4": 4, "IPv6": 6}
TOTAL = "*"  # SliceSet.problems' key for what is not about one slice (no slice can be named "*")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# Ranges no pod lives in: an address there reaches this node or the cloud (169.254.169.254), never a replica.
SPECIAL: tuple[tuple[str, IPNetwork], ...] = (
    ("loopback", ipaddress.ip_network("127.0.0.0/8")),
    ("loopback", ipaddress.ip_network("::1/128")),
    ("link-local", ipaddress.ip_network("169.254.0.0/16")),
    ("link-local", ipaddress.ip_network("fe80::/10")),
)
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
        """The Service's slices that its controller manages (``SliceRules`` checks the label again: the selector
        is the API server's filter, not a promise the router takes on trust)."""
        return f"{SERVICE_LABEL}={self.service},{MANAGED_BY_LABEL}={CONTROLLER}"

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


@dataclass(frozen=True)
class SliceRules:
    """What an EndpointSlice must be for its endpoints to become replicas (the module's docstring has the rule).

    >>> rules = SliceRules.of(["10.244.0.0/16"])
    >>> rules.refusal("10.244.1.7", "IPv4"), rules.refusal("10.9.0.1", "IPv4")
    (None, 'outside --pod-cidr 10.244.0.0/16')
    >>> SliceRules().refusal("169.254.169.254", "IPv4")
    'a link-local address'
    """

    pod_cidrs: tuple[IPNetwork, ...] = ()
    max_slice_endpoints: int = MAX_SLICE_ENDPOINTS
    max_replicas: int = MAX_REPLICAS

    @classmethod
    def of(
        cls,
        pod_cidrs: Iterable[str] = (),
        *,
        max_slice_endpoints: int = MAX_SLICE_ENDPOINTS,
        max_replicas: int = MAX_REPLICAS,
    ) -> SliceRules:
        """Rules from the router's settings; ``ConfigError`` for a CIDR that is not one."""
        return cls(tuple(parse_cidr(c) for c in pod_cidrs), max_slice_endpoints, max_replicas)

    def refusal(self, address: str, address_type: str | None) -> str | None:  # noqa: PLR0911 - one per reason
        """Why ``address`` (of a slice of ``address_type``) is no replica, or None when it may be one."""
        if "%" in address:  # a zone index (fe80::1%eth0): a link-local address of one node's interface
            return "an address with a zone index"
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return "not an IP literal"
        wanted = ADDRESS_TYPES.get(address_type or "")
        if wanted is not None and ip.version != wanted:
            return f"not an {address_type} address"
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return "an IPv4-mapped IPv6 address"  # a pod has its own address; this form only disguises another
        if ip.is_unspecified or ip.is_multicast:
            return "an unspecified or multicast address"
        cidrs = [c for c in self.pod_cidrs if c.version == ip.version]
        for kind, special in SPECIAL:
            if special.version != ip.version or ip not in special:
                continue
            # Only a CIDR inside the range itself lets such an address in: 0.0.0.0/0 is no reason to reach the node.
            if not any(ip in c and c.subnet_of(special) for c in cidrs):  # type: ignore[arg-type]  # same version
                return f"a {kind} address"
        if self.pod_cidrs and not any(ip in c for c in cidrs):
            return f"outside --pod-cidr {', '.join(str(c) for c in self.pod_cidrs)}"
        return None


def parse_cidr(text: str) -> IPNetwork:
    """``10.244.0.0/16`` or ``fd00:10:244::/56``; ``ConfigError`` for anything else (host bits set included)."""
    try:
        return ipaddress.ip_network(text.strip())
    except ValueError as exc:
        raise ConfigError(f"--pod-cidr {text!r}: {exc} (write a network such as 10.244.0.0/16)") from None


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


@dataclass(frozen=True)
class SliceView:
    """What one slice holds for the router: its replica URLs, and the addresses refused (address, why)."""

    urls: frozenset[str]
    refused: tuple[tuple[str, str], ...] = ()


def read_slice(
    slice_: Mapping[str, object], port_name: str | None = None, rules: SliceRules | None = None
) -> SliceView:
    """The replicas one EndpointSlice holds under ``rules``: each ready endpoint's first address on the chosen port.
    ``RouterError`` when the whole slice counts for nothing (not the controller's, not of IP addresses, too big, or
    several ports to choose from); addresses refused one by one are in ``refused``.

    >>> s = {"metadata": {"name": "r-abc", "labels": {MANAGED_BY_LABEL: CONTROLLER}}, "addressType": "IPv4",
    ...      "ports": [{"name": "http", "port": 8000}],
    ...      "endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": True}},
    ...                    {"addresses": ["10.0.0.6"], "conditions": {"ready": False, "terminating": True}},
    ...                    {"addresses": ["169.254.169.254"]}]}
    >>> view = read_slice(s)
    >>> sorted(view.urls), view.refused
    (['http://10.0.0.5:8000'], (('169.254.169.254', 'a link-local address'),))
    """
    rules = rules if rules is not None else SliceRules()
    where = f"EndpointSlice {_name(slice_)!r}"
    metadata = slice_.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    managed_by = labels.get(MANAGED_BY_LABEL) if isinstance(labels, Mapping) else None
    if managed_by != CONTROLLER:
        raise RouterError(
            f"{where} is not managed by the endpoint-slice controller ({MANAGED_BY_LABEL}={managed_by!r}, not "
            f"{CONTROLLER!r}): its endpoints are not replicas"
        )
    address_type = slice_.get("addressType")
    if address_type is not None and address_type not in ADDRESS_TYPES:
        raise RouterError(f"{where} has addressType {address_type!r}: only IPv4 and IPv6 slices hold replicas")
    endpoints = _list(slice_.get("endpoints"))
    if len(endpoints) > rules.max_slice_endpoints:
        raise RouterError(
            f"{where} holds {len(endpoints)} endpoints, more than the {rules.max_slice_endpoints} a slice may "
            "(--max-slice-endpoints): none of them are replicas"
        )
    port = _port(slice_, port_name, where)
    if port is None:
        return SliceView(frozenset())
    urls: set[str] = set()
    refused: list[tuple[str, str]] = []
    for endpoint in endpoints:
        addresses = endpoint.get("addresses")
        # "Consumers ... may choose to only use the first element" (EndpointSlice API): one endpoint, one replica.
        address = addresses[0] if isinstance(addresses, list) and addresses else None
        if not isinstance(address, str) or not address or not ready(endpoint):
            continue
        why = rules.refusal(address, address_type if isinstance(address_type, str) else None)
        if why is None:
            urls.add(host_url(address, port))
        else:
            refused.append((address[:64], why))
    return SliceView(frozenset(urls), tuple(refused))


def slice_urls(
    slice_: Mapping[str, object], port_name: str | None = None, rules: SliceRules | None = None
) -> frozenset[str]:
    """The replica URLs one EndpointSlice holds (``read_slice``'s ``urls``)."""
    return read_slice(slice_, port_name, rules).urls


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
    moment while the controller moves it: the union counts it once), at most ``rules.max_replicas`` of them.

    >>> slices = SliceSet(port=None)
    >>> one = {"metadata": {"name": "a", "labels": {MANAGED_BY_LABEL: CONTROLLER}}, "ports": [{"port": 80}],
    ...        "endpoints": [{"addresses": ["10.0.0.1"]}]}
    >>> slices.apply("ADDED", one)
    True
    >>> slices.apply("DELETED", one), slices.urls()
    (True, frozenset())
    """

    port: str | None
    rules: SliceRules = field(default_factory=SliceRules)
    _slices: dict[str, frozenset[str]] = field(default_factory=dict)
    _current: frozenset[str] = frozenset()
    # Per slice, why it (or some of its addresses) counts for no replica: the watcher logs each once. TOTAL: the
    # replicas left waiting because max_replicas are followed already.
    problems: dict[str, str] = field(default_factory=dict)

    def urls(self) -> frozenset[str]:
        return self._current

    def reset(self, items: Iterable[Mapping[str, object]]) -> bool:
        """Replace everything with a fresh list's items; True when the replica set changed."""
        before = self._current
        self.problems.clear()
        self._slices = {_name(item): self._urls(item) for item in items}
        self._settle()
        return self._current != before

    def apply(self, kind: str, obj: Mapping[str, object]) -> bool:
        """Fold one watch event in (``ADDED``, ``MODIFIED``, ``DELETED``; others change nothing); True when the
        replica set changed."""
        before = self._current
        name = _name(obj)
        if kind in ("ADDED", "MODIFIED"):
            self._slices[name] = self._urls(obj)
        elif kind == "DELETED":
            self._slices.pop(name, None)
            self.problems.pop(name, None)
        else:
            return False
        self._settle()
        return self._current != before

    def _settle(self) -> None:
        """The replica set from the slices: those already followed stay while a slice holds them; new ones join
        while there is room under ``max_replicas`` (in address order, so the same slices give the same set)."""
        wanted: frozenset[str] = frozenset().union(*self._slices.values())
        kept = self._current & wanted
        room = max(self.rules.max_replicas - len(kept), 0)
        waiting = sorted(wanted - kept)
        self._current = kept | frozenset(waiting[:room])
        if len(waiting) > room:
            self.problems[TOTAL] = (
                f"{len(waiting) - room} ready endpoints are not followed: {self.rules.max_replicas} replicas are "
                "(--max-discovered-replicas)"
            )
        else:
            self.problems.pop(TOTAL, None)

    def _urls(self, obj: Mapping[str, object]) -> frozenset[str]:
        name = _name(obj)
        self.problems.pop(name, None)
        try:
            view = read_slice(obj, self.port, self.rules)
        except RouterError as exc:
            self.problems[name] = str(exc)
            return frozenset()
        if view.refused:
            shown = ", ".join(f"{address} ({why})" for address, why in view.refused[:3])
            more = f" and {len(view.refused) - 3} more" if len(view.refused) > 3 else ""
            self.problems[name] = f"EndpointSlice {name!r}: addresses that are not replicas: {shown}{more}"
        return view.urls
