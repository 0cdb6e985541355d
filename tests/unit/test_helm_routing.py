"""Offline checks of the chart's prefix-affine routing options (helm/deltakv/ci/routing-values):
the Gateway API Inference Extension InferencePool (+ HTTPRoute) and the Envoy ring-hash
affinity router. Rendering, strict schema validation (built-in kinds by kubernetes-validate,
the custom resources by tests/support/crd_schemas.py) and lint run in test_helm_chart.py for
every ci values file; here: the objects point at each other and at the right ports, and the
router gets the same TLS and NetworkPolicy treatment as decode (it holds no pairing key)."""

from __future__ import annotations

import helm_python
import pytest
import yaml

from tests.support.helm import (
    CHART,
    NAMESPACE,
    RELEASE,
    deep_merge,
    deployment,
    flag_value,
    named,
    of_kind,
    ports_by_name,
    render,
    values_of,
    with_choice,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def routing():
    with helm_python.Chart.load(CHART) as chart:
        values = values_of("routing")
        yield chart.merge_values(values), render(chart, values), chart


def test_defaults_render_no_routing_objects():
    with helm_python.Chart.load(CHART) as chart:
        kinds = {o["kind"] for o in render(chart, with_choice(None))}
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
            for n, item in listeners.items()} == {"grpc": r["grpcPort"], "http": r["httpPort"],
                                                  "health": r["healthPort"]}
    for name in ("grpc", "http"):
        listener = listeners[name]
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
    assert ports_by_name(envoy) == {"grpc": r["grpcPort"], "http": r["httpPort"],
                                    "health": r["healthPort"]}
    assert service["spec"]["selector"].items() <= \
        router["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize(("values", "message"), [
    ({"inferencePool": {"enabled": True}, "decode": {"httpPort": 0}}, "needs decode.httpPort"),
    ({"inferencePool": {"enabled": True, "httpRoute": {"enabled": True}}}, "gatewayName"),
    ({"affinityRouter": {"enabled": True}, "decode": {"httpPort": 0}}, "decode.httpPort"),
])
def test_routing_rules_fail_rendering_with_a_clear_message(routing, values, message):
    _, _, chart = routing
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart.render(values=with_choice(values), name=RELEASE, namespace=NAMESPACE)


def test_schema_rejects_a_bad_session_header(routing):
    _, _, chart = routing
    with pytest.raises(helm_python.HelmValuesError, match="sessionHeader"):
        chart.render(values={"affinityRouter": {"sessionHeader": "X Bad"}}, name=RELEASE,
                     namespace=NAMESPACE)


def _router_config(objects):
    return yaml.safe_load(named(objects, "ConfigMap", f"{RELEASE}-deltakv-router")
                          ["data"]["envoy.yaml"])


TLS_DIR = "/etc/deltakv/tls"
OWN_CERT = [{"certificate_chain": {"filename": f"{TLS_DIR}/tls.crt"},
             "private_key": {"filename": f"{TLS_DIR}/tls.key"}}]


@pytest.mark.parametrize("client_certs", [False, True])
def test_router_speaks_tls_on_both_sides_like_decode(routing, client_certs):
    values, objects, chart = routing
    if client_certs:
        values = deep_merge(values_of("routing"), {"tls": {"requireClientCert": True}})
        objects = render(chart, values)
        values = chart.merge_values(values)
    config = _router_config(objects)
    decode_fqdn = f"{RELEASE}-deltakv-decode.{NAMESPACE}.svc.{values['clusterDomain']}"
    # Every listener that reaches decode serves TLS; the health listener (plain HTTP for the
    # kubelet) answers its fixed 200 and routes nowhere.
    for listener in config["static_resources"]["listeners"]:
        (chain,) = listener["filter_chains"]
        if listener["name"] == "health":
            manager = chain["filters"][0]["typed_config"]
            assert [("route" in route, route["direct_response"]["status"]) for route in
                    manager["route_config"]["virtual_hosts"][0]["routes"]] == [(False, 200)]
            continue
        context = chain["transport_socket"]["typed_config"]
        assert context["@type"].endswith("DownstreamTlsContext")
        assert context["require_client_certificate"] is client_certs
        common = context["common_tls_context"]
        assert common["tls_certificates"] == OWN_CERT
        assert ("validation_context" in common) is client_certs
        if client_certs:
            assert common["validation_context"] == {"trusted_ca": {"filename": f"{TLS_DIR}/ca.crt"}}
        assert "h2" in common["alpn_protocols"]
    for cluster in config["static_resources"]["clusters"]:
        context = cluster["transport_socket"]["typed_config"]
        assert context["@type"].endswith("UpstreamTlsContext")
        assert context["sni"] == decode_fqdn
        common = context["common_tls_context"]
        assert common["tls_certificates"] == OWN_CERT  # decode may require a client certificate
        assert common["validation_context"] == {
            "trusted_ca": {"filename": f"{TLS_DIR}/ca.crt"},
            "match_typed_subject_alt_names": [{"san_type": "DNS",
                                               "matcher": {"exact": decode_fqdn}}]}
    pod = named(objects, "Deployment", f"{RELEASE}-deltakv-router")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(volumes) == {"config", "tls"}  # no pairing key: the router never meets a sidecar
    assert volumes["tls"]["secret"]["secretName"] == f"{RELEASE}-deltakv-tls"
    (envoy,) = pod["containers"]
    assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in envoy["volumeMounts"]
    service = named(objects, "Service", f"{RELEASE}-deltakv-router")
    assert all("appProtocol" not in p for p in service["spec"]["ports"])  # not h2c: TLS
    decode_http = [p for p in named(objects, "Service", f"{RELEASE}-deltakv-decode")
                   ["spec"]["ports"] if p["name"] == "http"]
    assert [p["appProtocol"] for p in decode_http] == ["https"]
    (certificate,) = of_kind(objects, "Certificate")
    assert f"{RELEASE}-deltakv-router.{NAMESPACE}.svc.{values['clusterDomain']}" in \
        certificate["spec"]["dnsNames"]
    worker = deployment(objects, "decode")["spec"]["template"]["spec"]["containers"][0]
    assert flag_value(worker["args"], "--tls-cert") == f"{TLS_DIR}/tls.crt"  # HTTPS on --http-port


def test_router_in_plain_text_only_when_insecure(routing):
    _, _, chart = routing
    values = deep_merge(values_of("routing"), {"insecure": True, "tls": {"enabled": False}})
    objects = render(chart, values)
    config = _router_config(objects)
    assert all("transport_socket" not in c for c in config["static_resources"]["clusters"])
    assert all("transport_socket" not in chain for listener in
               config["static_resources"]["listeners"] for chain in listener["filter_chains"])
    pod = named(objects, "Deployment", f"{RELEASE}-deltakv-router")["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {"config"}
    service = named(objects, "Service", f"{RELEASE}-deltakv-router")
    assert {p["name"]: p.get("appProtocol") for p in service["spec"]["ports"]} == {
        "grpc": "kubernetes.io/h2c", "http": None}


def _policy(objects, name):
    return named(objects, "NetworkPolicy", f"{RELEASE}-deltakv-{name}")["spec"]


def test_network_policies_admit_the_router_to_decode_and_the_front_end_to_the_router(routing):
    values, objects, chart = routing
    r, decode = values["affinityRouter"], values["decode"]
    router_pods = {"podSelector": {"matchLabels": {
        "app.kubernetes.io/component": "router", "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/name": "deltakv"}}}
    front = _policy(objects, "decode")["ingress"][0]
    assert router_pods in front["from"]
    assert {p["port"] for p in front["ports"]} == {decode["port"], decode["httpPort"]}
    router = _policy(objects, "router")
    labels = named(objects, "Deployment", f"{RELEASE}-deltakv-router")[
        "spec"]["template"]["metadata"]["labels"]
    assert router["podSelector"]["matchLabels"].items() <= labels.items()
    rule = router["ingress"][0]
    assert rule["from"] == values["networkPolicy"]["frontend"]
    assert {p["port"] for p in rule["ports"]} == {r["grpcPort"], r["httpPort"]}
    # The health port is open to networkPolicy.healthFrom only (the kubelet needs no rule).
    health_rules = [rule for rule in router["ingress"]
                    if r["healthPort"] in {p["port"] for p in rule["ports"]}]
    if values["networkPolicy"]["healthFrom"]:
        assert [(h["from"], len(h["ports"])) for h in health_rules] == [
            (values["networkPolicy"]["healthFrom"], 1)]
    else:
        assert health_rules == [] and len(router["ingress"]) == 1
    # The router reaches no sidecar: no rule names it on prefill or on decode's engine ports.
    prefill_sources = [s for rule in _policy(objects, "prefill")["ingress"] for s in rule["from"]]
    assert router_pods not in prefill_sources
    # Without a front end the router accepts nobody (an empty `from` would allow everyone).
    closed = render(chart, deep_merge(values_of("routing"), {"networkPolicy": {"frontend": []}}))
    assert _policy(closed, "router")["ingress"] == []


def test_the_router_has_the_probe_set_of_every_workload_on_envoys_own_health_endpoint(routing):
    """Startup, readiness and liveness, with the timings of values.probes, all on a listener
    Envoy's workers answer (GET /ready, plain HTTP on the declared health port): a hung Envoy
    fails them, where a TCP probe would pass (the kernel completes the handshake)."""
    values, objects, _ = routing
    r, timings = values["affinityRouter"], values["probes"]
    envoy = named(objects, "Deployment", f"{RELEASE}-deltakv-router")[
        "spec"]["template"]["spec"]["containers"][0]
    assert ports_by_name(envoy)["health"] == r["healthPort"]
    for probe in ("startup", "readiness", "liveness"):
        spec = envoy[f"{probe}Probe"]
        assert spec["httpGet"] == {"path": "/ready", "port": "health"}, probe
        for key in ("periodSeconds", "failureThreshold", "timeoutSeconds"):
            assert spec[key] == timings[probe][key], (probe, key)
    listeners = {item["name"]: item for item in _router_config(objects)["static_resources"]
                 ["listeners"]}
    health = listeners["health"]
    assert health["address"]["socket_address"] == {"address": "0.0.0.0",
                                                   "port_value": r["healthPort"]}
    assert "transport_socket" not in health["filter_chains"][0]  # the kubelet speaks plain HTTP
    manager = health["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert route["match"] == {"path": "/ready"}
    assert route["direct_response"]["status"] == 200
