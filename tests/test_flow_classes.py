"""A request's band and tenant from its headers and body (kvrouter.flow.classes)."""

from __future__ import annotations

import pytest

from kvrouter.flow.classes import ANONYMOUS, FlowClassifier
from kvrouter.flow.settings import BandConfig, FlowConfig, TenantConfig
from kvrouter.openai_request import RequestError

CONFIG = FlowConfig(tenants={"team-a": TenantConfig(weight=2.0, api_keys=["sk-team-a"])})
HIGH, NORMAL, LOW = 0, 1, 2


@pytest.fixture
def classifier() -> FlowClassifier:
    return FlowClassifier(CONFIG)


def test_priority_from_the_header_or_the_body(classifier: FlowClassifier) -> None:
    assert classifier.classify({"x-kvrouter-priority": "high"}, "", {}).band == HIGH
    assert classifier.classify({"x-kvrouter-priority": "LOW"}, "", {}).band == LOW
    assert classifier.classify({}, "", {}).band == NORMAL
    # vLLM's integer priority: lower is more urgent, moved from the default band and clamped.
    assert classifier.classify({}, "", {"priority": -1}).band == HIGH
    assert classifier.classify({}, "", {"priority": 7}).band == LOW
    assert classifier.classify({"x-kvrouter-priority": "-5"}, "", {}).band == HIGH
    # The header wins over the body.
    assert classifier.classify({"x-kvrouter-priority": "low"}, "", {"priority": -1}).band == LOW


def test_an_unknown_band_gets_the_default_and_says_so(classifier: FlowClassifier) -> None:
    flow = classifier.classify({"x-kvrouter-priority": "urgent"}, "", {})
    assert flow.band == NORMAL and flow.unknown == ("unknown_priority",)


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({"x-kvrouter-priority": "very high!"}, {}, "x-kvrouter-priority"),
        ({"x-kvrouter-priority": ""}, {}, "x-kvrouter-priority"),
        ({}, {"priority": "high"}, "priority"),
        ({}, {"priority": True}, "priority"),
        ({}, {"priority": 1.5}, "priority"),
        ({"x-kvrouter-tenant": "a" * 65}, {}, "x-kvrouter-tenant"),
        ({"x-kvrouter-tenant": "team a"}, {}, "x-kvrouter-tenant"),
        ({}, {"user": 42}, "user"),
    ],
)
def test_malformed_values_are_a_400(
    classifier: FlowClassifier, headers: dict[str, str], body: dict[str, object], param: str
) -> None:
    with pytest.raises(RequestError) as caught:
        classifier.classify(headers, "", body)
    assert caught.value.status == 400 and caught.value.param == param
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


def test_tenant_sources_in_order(classifier: FlowClassifier) -> None:
    by_header = classifier.classify({"x-kvrouter-tenant": "team-a"}, "sk-other", {"user": "u1"})
    assert (by_header.tenant, by_header.weight, by_header.label) == ("team-a", 2.0, "team-a")
    by_key = classifier.classify({}, "sk-team-a", {"user": "u1"})
    assert by_key.tenant == "team-a"
    other_key = classifier.classify({}, "sk-secret-value", {})
    assert other_key.tenant.startswith("key-") and "secret" not in other_key.tenant and other_key.label == "other"
    by_user = classifier.classify({}, "", {"user": "alice@example.com"})
    assert by_user.tenant.startswith("user-") and by_user.weight == 1.0
    assert classifier.classify({}, "", {"user": "alice"}).tenant == "alice"
    assert classifier.classify({}, "", {}).tenant == ANONYMOUS


def test_an_unlisted_tenant_header_is_counted_when_tenants_are_configured(classifier: FlowClassifier) -> None:
    flow = classifier.classify({"x-kvrouter-tenant": "stranger"}, "", {})
    assert flow.tenant == "stranger" and flow.unknown == ("unknown_tenant",) and flow.label == "other"
    open_config = FlowClassifier(FlowConfig())
    assert open_config.classify({"x-kvrouter-tenant": "stranger"}, "", {}).unknown == ()


def test_tenant_from_is_configurable() -> None:
    only_user = FlowClassifier(FlowConfig(tenant_from=["user"]))
    assert only_user.classify({"x-kvrouter-tenant": "team-a"}, "sk", {"user": "bob"}).tenant == "bob"


def test_engine_priority_is_the_header_band_for_bodies_without_one() -> None:
    five = FlowConfig(
        bands=[BandConfig(name=name) for name in ("urgent", "high", "normal", "low", "batch")],
        engine_priority=True,
    )
    classifier = FlowClassifier(five)

    def written(headers: dict[str, str], body: dict[str, object]) -> int | None:
        return classifier.classify(headers, "", body).engine_priority

    assert written({"x-kvrouter-priority": "urgent"}, {}) == -2
    assert written({"x-kvrouter-priority": "batch"}, {}) == 2
    assert written({"x-kvrouter-priority": "9"}, {}) == 2  # clamped to the last band, written as that band
    assert written({"x-kvrouter-priority": "normal"}, {}) is None
    assert written({"x-kvrouter-priority": "high"}, {"priority": 0}) is None  # the client's field stays
    assert written({}, {"priority": -1}) is None
    off = FlowClassifier(FlowConfig())
    assert off.classify({"x-kvrouter-priority": "high"}, "", {}).engine_priority is None
