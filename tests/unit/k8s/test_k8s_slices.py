"""EndpointSlices, as the API server sends them (tests/data/k8s/), into the router's replica URLs: ready endpoints
are replicas, terminating or not-ready ones are not, and a watch stream's events move the set as they come."""

from __future__ import annotations

import json

import pytest

from k8sapi import DATA, fixture
from preheat.core.errors import ConfigError
from preheat.k8s.slices import ServiceRef, SliceSet, parse_k8s_url, resource_version, slice_urls


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
