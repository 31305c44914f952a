"""EndpointSlices, as the API server sends them (tests/data/k8s/), into the router's replica URLs: ready endpoints
are replicas, terminating or not-ready ones are not, and a watch stream's events move the set as they come."""

from __future__ import annotations

import ipaddress
import json
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8sapi import DATA, fixture
from preheat.core.errors import ConfigError, RouterError
from preheat.k8s.slices import (
    CONTROLLER,
    MANAGED_BY_LABEL,
    TOTAL,
    ServiceRef,
    SliceRules,
    SliceSet,
    parse_k8s_url,
    read_slice,
    resource_version,
    slice_urls,
)
from strategies import FUZZ


def test_ready_endpoints_of_a_recorded_slice_are_replicas_on_its_port() -> None:
    assert slice_urls(fixture("endpointslice-two-ready.json")) == {"http://10.244.1.17:8000", "http://10.244.2.9:8000"}


def test_a_terminating_endpoint_is_not_a_replica() -> None:
    assert slice_urls(fixture("endpointslice-one-terminating.json")) == {"http://10.244.1.17:8000"}


def test_an_endpoint_without_conditions_counts_as_ready_and_ipv6_is_bracketed() -> None:
    # The EndpointSlice API: "ready: nil ... should be interpreted as ready".
    assert slice_urls(fixture("endpointslice-ipv6.json")) == {"http://[fd00:10:244:1::11]:8000"}


def test_a_slice_with_two_ports_needs_the_port_named() -> None:
    two = fixture("endpointslice-two-ports.json")
    assert slice_urls(two, "http") == {"http://10.244.3.4:8000"}
    assert slice_urls(two, "grpc") == frozenset()  # not that Service's port: no replica, rather than a wrong one
    slices = SliceSet(port=None)
    slices.reset([two])
    assert slices.urls() == frozenset()
    assert "?port=NAME" in slices.problems["preheat-replicas-m2p8d"]


def test_the_recorded_watch_stream_moves_the_replica_set() -> None:
    slices = SliceSet(port="http")
    seen: list[tuple[str, bool, frozenset[str]]] = []
    for line in (DATA / "watch-endpointslices.jsonl").read_text().splitlines():
        event = json.loads(line)
        changed = slices.apply(event["type"], event["object"])
        seen.append((event["type"], changed, slices.urls()))
    both = {"http://10.244.1.17:8000", "http://10.244.2.9:8000"}
    assert seen == [
        ("ADDED", True, both),
        ("MODIFIED", True, {"http://10.244.1.17:8000"}),
        ("BOOKMARK", False, {"http://10.244.1.17:8000"}),
        ("DELETED", True, frozenset()),
    ]


def test_a_pod_in_two_slices_is_one_replica_and_stays_while_either_holds_it() -> None:
    first = fixture("endpointslice-two-ready.json")
    second = {**first, "metadata": {**first["metadata"], "name": "preheat-replicas-b9w4t"}}
    slices = SliceSet(port=None)
    slices.reset([first, second])
    assert len(slices.urls()) == 2
    assert slices.apply("DELETED", first) is False  # the controller moved them: still the same replicas


def test_resource_versions_come_from_lists_objects_and_bookmarks() -> None:
    assert resource_version(fixture("endpointslice-two-ready.json")) == "48213"
    bookmark = json.loads((DATA / "watch-endpointslices.jsonl").read_text().splitlines()[2])["object"]
    assert resource_version(bookmark) == "48501"
    assert resource_version({"metadata": {}}) is None


def test_k8s_urls_name_namespace_service_and_port() -> None:
    assert parse_k8s_url("k8s://llm/preheat-replicas") == ServiceRef("llm", "preheat-replicas", None)
    assert str(parse_k8s_url("k8s://llm/preheat-replicas?port=http")) == "k8s://llm/preheat-replicas?port=http"


@pytest.mark.parametrize(
    "url",
    ["http://llm/svc", "k8s://llm", "k8s://llm/a/b", "k8s:///svc", "k8s://LLM/svc", "k8s://llm/svc?prot=http",
     "k8s://llm/svc?port=http&port=grpc", "k8s://llm/svc_1"],
)  # fmt: skip
def test_a_malformed_k8s_url_is_refused_with_the_form_to_use(url: str) -> None:
    with pytest.raises(ConfigError, match=r"k8s://NAMESPACE/SERVICE"):
        parse_k8s_url(url)


def test_the_router_takes_replicas_from_a_service_by_flag_or_variable() -> None:
    from preheat.router.settings import RouterSettings

    by_flag = RouterSettings.resolve({"replicas": None, "replicas_from": "k8s://llm/preheat-replicas?port=http"}, {})
    assert (by_flag.replicas, by_flag.replicas_from) == ((), "k8s://llm/preheat-replicas?port=http")
    by_env = RouterSettings.resolve({}, {"PREHEAT_ROUTER_REPLICAS_FROM": "k8s://llm/preheat-replicas"})
    assert by_env.replicas_from == "k8s://llm/preheat-replicas"
    with pytest.raises(ConfigError, match=r"--replicas-from 'k8s://llm'"):
        RouterSettings.resolve({"replicas_from": "k8s://llm"}, {})
    with pytest.raises(ConfigError, match=r"pass --model DIR"):
        RouterSettings.resolve({"replicas_from": "k8s://llm/svc", "policy": "kv", "model": "@replicas"}, {})


# -- only what the cluster vouches for (issue 29) ---------------------------------------------------------------------
def controllers_slice(addresses: list[str], *, name: str = "preheat-replicas-7xk2q", kind: str = "IPv4") -> Any:
    """The recorded slice (the controller's label on it) with one ready endpoint per address."""
    recorded = fixture("endpointslice-two-ready.json")
    template = recorded["endpoints"][0]
    recorded["metadata"]["name"] = name
    recorded["addressType"] = kind
    recorded["endpoints"] = [{**template, "addresses": [address]} for address in addresses]
    return recorded


def test_a_slice_the_controller_does_not_manage_holds_no_replica() -> None:
    by_hand = controllers_slice(["10.244.1.17"])
    by_hand["metadata"]["labels"][MANAGED_BY_LABEL] = "someone-else"
    slices = SliceSet(port=None)
    slices.reset([by_hand])
    assert slices.urls() == frozenset()
    assert "not managed by the endpoint-slice controller" in slices.problems["preheat-replicas-7xk2q"]
    del by_hand["metadata"]["labels"][MANAGED_BY_LABEL]
    with pytest.raises(RouterError, match=MANAGED_BY_LABEL):
        read_slice(by_hand)


def test_an_fqdn_slice_holds_no_replica() -> None:
    with pytest.raises(RouterError, match="addressType 'FQDN'"):
        read_slice(controllers_slice(["replica.attacker.example"], kind="FQDN"))
    # A name inside an IPv4 slice (the API server would refuse it; a forged object need not be valid) is no replica.
    view = read_slice(controllers_slice(["replica.attacker.example", "10.244.1.17"]))
    assert view.urls == {"http://10.244.1.17:8000"}
    assert view.refused == (("replica.attacker.example", "not an IP literal"),)


@pytest.mark.parametrize(
    ("address", "kind", "why"),
    [
        ("169.254.169.254", "IPv4", "a link-local address"),
        ("127.0.0.1", "IPv4", "a loopback address"),
        ("0.0.0.0", "IPv4", "an unspecified or multicast address"),
        ("224.0.0.1", "IPv4", "an unspecified or multicast address"),
        ("::1", "IPv6", "a loopback address"),
        ("fe80::1", "IPv6", "a link-local address"),
        ("fe80::1%eth0", "IPv6", "an address with a zone index"),
        ("::ffff:169.254.169.254", "IPv6", "an IPv4-mapped IPv6 address"),  # the metadata address, disguised
        ("10.244.1.17", "IPv6", "not an IPv6 address"),
        ("010.244.1.17", "IPv4", "not an IP literal"),
    ],
)
def test_addresses_that_reach_the_node_or_the_cloud_are_no_replicas(address: str, kind: str, why: str) -> None:
    assert SliceRules().refusal(address, kind) == why


def test_a_pod_cidr_admits_only_its_addresses_and_loopback_only_when_it_is_loopback() -> None:
    pods = SliceRules.of(["10.244.0.0/16", "fd00:10:244::/56"])
    assert pods.refusal("10.244.200.1", "IPv4") is None
    assert pods.refusal("fd00:10:244::11", "IPv6") is None
    assert pods.refusal("10.96.0.1", "IPv4") == "outside --pod-cidr 10.244.0.0/16, fd00:10:244::/56"
    assert SliceRules.of(["127.0.0.0/8"]).refusal("127.0.0.2", "IPv4") is None  # the tests' "pods"
    everything = SliceRules.of(["0.0.0.0/0"])
    assert everything.refusal("169.254.169.254", "IPv4") == "a link-local address"  # not by accident
    assert everything.refusal("127.0.0.1", "IPv4") == "a loopback address"
    with pytest.raises(ConfigError, match=r"--pod-cidr '10\.244\.0\.1/16'"):
        SliceRules.of(["10.244.0.1/16"])  # host bits set: a typo, not a network


def test_a_slice_bigger_than_the_api_server_allows_is_refused_whole() -> None:
    flood = controllers_slice([f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(20_000)])
    slices = SliceSet(port=None)
    assert slices.reset([flood]) is False
    assert slices.urls() == frozenset()
    assert "holds 20000 endpoints, more than the 1000" in slices.problems["preheat-replicas-7xk2q"]
    small = SliceSet(port=None, rules=SliceRules(max_slice_endpoints=2))
    small.reset([controllers_slice(["10.0.0.1", "10.0.0.2", "10.0.0.3"])])
    assert small.urls() == frozenset()


def test_only_an_endpoints_first_address_is_a_replica() -> None:
    slice_ = controllers_slice(["10.0.0.1"])
    slice_["endpoints"][0]["addresses"] = ["10.0.0.1", *(f"10.0.1.{i}" for i in range(99))]
    assert slice_urls(slice_) == {"http://10.0.0.1:8000"}


def test_past_the_cap_the_known_replicas_stay_and_new_ones_wait_for_room() -> None:
    slices = SliceSet(port=None, rules=SliceRules(max_replicas=2))
    slices.reset([controllers_slice(["10.0.0.8", "10.0.0.9"], name="a")])
    known = {"http://10.0.0.8:8000", "http://10.0.0.9:8000"}
    assert slices.urls() == known
    assert slices.apply("ADDED", controllers_slice(["10.0.0.1", "10.0.0.2"], name="b")) is False
    assert slices.urls() == known  # addresses that sort first do not push the known ones out
    assert "2 ready endpoints are not followed" in slices.problems[TOTAL]
    assert slices.apply("MODIFIED", controllers_slice(["10.0.0.8"], name="a")) is True
    assert slices.urls() == {"http://10.0.0.8:8000", "http://10.0.0.1:8000"}
    slices.apply("DELETED", controllers_slice([], name="b"))
    assert slices.urls() == {"http://10.0.0.8:8000"}
    assert TOTAL not in slices.problems


def test_the_router_declares_the_discovery_rules_once_as_flags_and_variables() -> None:
    from preheat.router.settings import RouterSettings

    flags = {"replicas_from": "k8s://llm/svc", "pod_cidr": ["10.244.0.0/16"], "max_discovered_replicas": 50}
    resolved = RouterSettings.resolve(flags, {})
    assert (resolved.pod_cidr, resolved.max_discovered_replicas, resolved.max_slice_endpoints) == (
        ("10.244.0.0/16",), 50, 1000)  # fmt: skip
    by_env = RouterSettings.resolve(
        {"replicas_from": "k8s://llm/svc"}, {"PREHEAT_ROUTER_POD_CIDR": "10.244.0.0/16,fd00::/56"}
    )
    assert by_env.pod_cidr == ("10.244.0.0/16", "fd00::/56")
    with pytest.raises(ConfigError, match="--pod-cidr 'pods'"):
        RouterSettings.resolve({"replicas_from": "k8s://llm/svc", "pod_cidr": ["pods"]}, {})
    with pytest.raises(ConfigError, match="--max-slice-endpoints must be at least 1"):
        RouterSettings.resolve({"replicas_from": "k8s://llm/svc", "max_slice_endpoints": 0}, {})


# -- properties -------------------------------------------------------------------------------------------------------
ADDRESSES = st.sampled_from([
    "10.244.1.17", "10.244.2.9", "10.0.0.1", "169.254.169.254", "127.0.0.1", "0.0.0.0", "::1", "fe80::1",
    "fd00:10:244::11", "::ffff:169.254.169.254", "224.0.0.1", "replica.attacker.example", "", "10.244.1.17 ",
    "1.2.3.4:80", "[::1]", "fe80::1%eth0", "10.244.1.300",
])  # fmt: skip
KINDS = st.sampled_from(["IPv4", "IPv6", "FQDN", None, 7])
LABELS = st.sampled_from([CONTROLLER, "someone-else", None])
endpoint = st.fixed_dictionaries(
    {"addresses": st.one_of(st.lists(ADDRESSES, max_size=3), st.none(), st.just("10.0.0.1"))},
    optional={"conditions": st.fixed_dictionaries({"ready": st.sampled_from([True, False, None])})},
)
slices_ = st.builds(
    lambda name, label, kind, endpoints: {
        "metadata": {"name": name, "labels": {} if label is None else {MANAGED_BY_LABEL: label}},
        "addressType": kind, "ports": [{"port": 8000}], "endpoints": endpoints},
    st.sampled_from(["a", "b", "c"]), LABELS, KINDS, st.lists(endpoint, max_size=6),
)  # fmt: skip
events = st.lists(st.tuples(st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]), slices_), max_size=12)
CIDRS = st.sampled_from([(), ("10.244.0.0/16",), ("127.0.0.0/8",), ("0.0.0.0/0", "::/0"), ("169.254.0.0/16",)])


def held(obj: dict[str, Any], rules: SliceRules) -> frozenset[str]:
    try:
        return read_slice(obj, None, rules).urls
    except RouterError:
        return frozenset()


@FUZZ
@given(events, CIDRS, st.integers(min_value=1, max_value=4))
def test_whatever_the_slices_say_the_replicas_are_ip_literals_the_rules_allow(
    changes: list[tuple[str, dict[str, Any]]], cidrs: tuple[str, ...], cap: int
) -> None:
    rules = SliceRules.of(cidrs, max_slice_endpoints=4, max_replicas=cap)
    slices = SliceSet(port=None, rules=rules)
    current: dict[str, dict[str, Any]] = {}  # the slices as the API server holds them, after each event
    for kind, obj in changes:
        before = slices.urls()
        slices.apply(kind, obj)
        if kind in ("ADDED", "MODIFIED"):
            current[obj["metadata"]["name"]] = obj
        elif kind == "DELETED":
            current.pop(obj["metadata"]["name"], None)
        now = slices.urls()
        wanted = frozenset().union(*(held(o, rules) for o in current.values()))
        assert now <= wanted  # nothing but what a slice holds now
        assert before & wanted <= now  # a replica still held stays, whatever else came
        assert len(now) == min(cap, len(wanted))  # room is never left empty while a replica waits
        for url in now:
            parts = urlsplit(url)
            assert (parts.scheme, parts.port, parts.path) == ("http", 8000, "")
            address = ipaddress.ip_address(parts.hostname or "")
            assert not address.is_unspecified
            assert not address.is_multicast
            assert not (isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped)
            if address.is_loopback or address.is_link_local:  # only where a CIDR of that range itself names it
                assert any(address in ipaddress.ip_network(c) for c in cidrs if not c.startswith(("0.", "::/")))
            if cidrs:
                assert any(address in ipaddress.ip_network(c) for c in cidrs)
    for obj in current.values():
        if obj["metadata"]["labels"].get(MANAGED_BY_LABEL) != CONTROLLER or obj["addressType"] not in (
            "IPv4", "IPv6", None):  # fmt: skip
            assert held(obj, rules) == frozenset()
