"""Offline checks of the chart's prefix-affine routing options (helm/deltakv/ci/routing-values):
the Gateway API Inference Extension InferencePool (+ HTTPRoute) and the Envoy ring-hash
affinity router. Rendering, strict schema validation (built-in kinds by kubernetes-validate,
the custom resources by tests/support/crd_schemas.py) and lint run in test_helm_chart.py for
every ci values file; here: the objects point at each other and at the right ports."""

from __future__ import annotations

import helm_python
import pytest
import yaml

from tests.unit.test_helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    deployment,
    flag_value,
    named,
    ports_by_name,
    render,
    values_of,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def routing():
    with helm_python.Chart.load(CHART) as chart:
        values = values_of("routing")
        yield chart.merge_values(values), render(chart, values), chart


def test_defaults_render_no_routing_objects():
    with helm_python.Chart.load(CHART) as chart:
        kinds = {o["kind"] for o in render(chart, None)}
    assert not kinds & {"InferencePool", "HTTPRoute"}


def test_inference_pool_selects_the_decode_pods_on_their_http_port(routing):
    values, objects, _ = routing
    pool = named(objects, "InferencePool", f"{RELEASE}-deltakv-decode")
    decode = deployment(objects, "decode")
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    worker = decode["spec"]["template"]["spec"]["containers"][0]
    assert pool["spec"]["targetPorts"] == [{"number": ports_by_name(worker)["http"]}]
    assert int(flag_value(worker["args"], "--http-port")) == values["decode"]["httpPort"]
    picker = pool["spec"]["endpointPickerRef"]
    assert (picker["name"], picker["port"]["number"], picker["failureMode"]) == (
        "deltakv-epp", 9002, "FailOpen")
    route = named(objects, "HTTPRoute", f"{RELEASE}-deltakv-decode")
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])


def test_envoy_ring_hash_on_the_session_header_over_every_decode_pod(routing):
    values, objects, _ = routing
    r = values["affinityRouter"]
    config = yaml.safe_load(named(objects, "ConfigMap", f"{RELEASE}-deltakv-router")
                            ["data"]["envoy.yaml"])
    headless = named(objects, "Service", f"{RELEASE}-deltakv-decode-headless")
    assert headless["spec"]["clusterIP"] == "None"
    fqdn = f"{RELEASE}-deltakv-decode-headless.{NAMESPACE}.svc.{values['clusterDomain']}"
    ports = {"grpc": values["decode"]["port"], "http": values["decode"]["httpPort"]}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for name, port in ports.items():
        cluster = clusters[f"decode_{name}"]
        assert (cluster["type"], cluster["lb_policy"]) == ("STRICT_DNS", "RING_HASH")
        assert cluster["ring_hash_lb_config"]["minimum_ring_size"] == r["ringSize"]
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert (address["address"], address["port_value"]) == (fqdn, port)
        assert {p["port"] for p in headless["spec"]["ports"]} >= {port}
    assert "typed_extension_protocol_options" in clusters["decode_grpc"]  # HTTP/2 upstream
    listeners = {item["name"]: item for item in config["static_resources"]["listeners"]}
    assert {n: item["address"]["socket_address"]["port_value"]
            for n, item in listeners.items()} == {"grpc": r["grpcPort"], "http": r["httpPort"]}
    for listener in listeners.values():
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
        assert route["route"]["hash_policy"] == [
            {"header": {"header_name": r["sessionHeader"]}}]
        assert route["route"]["timeout"] == "0s"  # streams are not cut
    router = named(objects, "Deployment", f"{RELEASE}-deltakv-router")
    assert router["spec"]["replicas"] == r["replicas"]
    envoy = router["spec"]["template"]["spec"]["containers"][0]
    service = named(objects, "Service", f"{RELEASE}-deltakv-router")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": r["grpcPort"], "http": r["httpPort"]}
    assert ports_by_name(envoy) == {"grpc": r["grpcPort"], "http": r["httpPort"]}
    assert service["spec"]["selector"].items() <= \
        router["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize(("values", "message"), [
    ({"inferencePool": {"enabled": True}, "decode": {"httpPort": 0}}, "needs decode.httpPort"),
    ({"inferencePool": {"enabled": True, "httpRoute": {"enabled": True}}}, "gatewayName"),
    ({"affinityRouter": {"enabled": True}, "tls": {"enabled": True, "secretName": "s"}},
     "not supported"),
    ({"affinityRouter": {"enabled": True}, "decode": {"httpPort": 0}}, "decode.httpPort"),
])
def test_routing_rules_fail_rendering_with_a_clear_message(routing, values, message):
    _, _, chart = routing
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


def test_schema_rejects_a_bad_session_header(routing):
    _, _, chart = routing
    with pytest.raises(helm_python.HelmValuesError, match="sessionHeader"):
        chart.render(values={"affinityRouter": {"sessionHeader": "X Bad"}}, name=RELEASE,
                     namespace=NAMESPACE)
