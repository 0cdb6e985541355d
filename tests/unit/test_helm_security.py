"""Offline checks of the chart's security wiring: NetworkPolicies, TLS sources, the pairing key.

The NetworkPolicy checks read the rendered policies the way a CNI applies them: for every port
a pod declares, the union of the sources of every rule that names it (no rule: nobody but the
pod's own node). Each declared port must have exactly the sources docs/helm.md promises, and a
rule must never be left with an empty ``from`` (which would allow everyone). Selectors are
matched against the rendered pods' own labels.
"""

from __future__ import annotations

import base64
from typing import Any

import helm_python
import pytest

from tests.support.helm import (
    CASES,
    CHART,
    NAMESPACE,
    RELEASE,
    deployment,
    flag_value,
    named,
    native_sidecars,
    of_kind,
    one_shot_inits,
    render,
    values_of,
    with_choice,
    workload_containers,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def rendered(chart):
    return {case: (chart.merge_values(values_of(case)), render(chart, values_of(case)))
            for case in CASES}


# --------------------------------------------------------------------------- NetworkPolicies


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """LabelSelector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_labels(objects, role: str) -> dict[str, str]:
    return deployment(objects, role)["spec"]["template"]["metadata"]["labels"]


def declared_ports(objects, role: str) -> dict[str, int]:
    spec = deployment(objects, role)["spec"]["template"]["spec"]
    return {p["name"]: p["containerPort"] for c in [*spec["initContainers"], *spec["containers"]]
            for p in c.get("ports", [])}


def sources(policy: dict[str, Any], port: int) -> list[dict[str, Any]] | None:
    """Peers allowed to ``port`` by ``policy`` (None: no rule names it, so nobody)."""
    found = None
    for rule in policy["spec"].get("ingress") or []:
        if any(p["port"] == port and p["protocol"] == "TCP" for p in rule["ports"]):
            found = (found or []) + rule["from"]
    return found


def test_policy_peer_helpers_are_not_vacuous():
    """The helpers above decide the tests below: a selector that names another pool must not
    match, and a port no rule names has no sources."""
    assert selects({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"})
    assert not selects({"matchLabels": {"a": "1"}}, {"a": "2"})
    assert not selects({"matchExpressions": [{"key": "a", "operator": "In", "values": ["x"]}]},
                       {"a": "y"})
    policy = {"spec": {"ingress": [{"from": [{"podSelector": {}}],
                                    "ports": [{"port": 1, "protocol": "TCP"}]}]}}
    assert sources(policy, 2) is None and sources(policy, 1) == [{"podSelector": {}}]


def router_labels(objects) -> list[dict[str, str]]:
    """Pod labels of the affinity router (empty list when it is off)."""
    return [d["spec"]["template"]["metadata"]["labels"] for d in of_kind(objects, "Deployment")
            if d["metadata"]["name"] == f"{RELEASE}-deltakv-router"]


def same_namespace_pods(peers, objects, role: str) -> bool:
    """Every peer is a same-namespace podSelector matching ``role``'s pods and no other
    deltakv pod (nor the test pod)."""
    others = [pod_labels(objects, r) for r in ("prefill", "decode") if r != role]
    others += [p["metadata"]["labels"] for p in of_kind(objects, "Pod")]
    others += router_labels(objects)
    return bool(peers) and all(
        set(peer) == {"podSelector"} and selects(peer["podSelector"], pod_labels(objects, role))
        and not any(selects(peer["podSelector"], o) for o in others) for peer in peers)


@pytest.mark.parametrize("case", CASES)
def test_network_policies_allow_exactly_the_documented_sources(case, rendered):
    values, objects = rendered[case]
    policies = of_kind(objects, "NetworkPolicy")
    if not values["networkPolicy"]["enabled"]:
        assert values["insecure"] and not policies
        return
    np = values["networkPolicy"]
    test_pods = of_kind(objects, "Pod")
    for role in ("decode", "prefill"):
        policy = named(objects, "NetworkPolicy", f"{RELEASE}-deltakv-{role}")
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        # The policy selects this pool's pods and only them.
        assert selects(policy["spec"]["podSelector"], pod_labels(objects, role))
        other = "prefill" if role == "decode" else "decode"
        assert not selects(policy["spec"]["podSelector"], pod_labels(objects, other))
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), f"{role}: a rule without sources allows everyone: {rule}"
        ports = declared_ports(objects, role)
        named_in_rules = {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]}
        assert named_in_rules <= set(ports.values()), "a rule names a port the pod lacks"
        for name, port in ports.items():
            got = sources(policy, port)
            if name in ("grpc", "http") and role == "decode":
                # DecodeService and the OpenAI API: the front end, the test pod, the router.
                expected = list(np["frontend"])
                assert got[:len(expected)] == expected, (name, got)
                extra = got[len(expected):]
                internal = [p["metadata"]["labels"] for p in test_pods] + router_labels(objects)
                assert len(extra) == len(internal), (name, extra)
                for peer, labels in zip(extra, internal, strict=True):
                    assert selects(peer["podSelector"], labels)
                    assert not selects(peer["podSelector"], pod_labels(objects, "prefill"))
            elif name == "grpc":
                assert same_namespace_pods(got, objects, "decode"), got
            elif name.startswith("xfer-"):
                if role == "decode":
                    assert same_namespace_pods(got, objects, "prefill"), got
                elif values["decode"]["giveback"] != "off":
                    # Give-back: decode's sidecars write the pages prefill lacks.
                    assert same_namespace_pods(got, objects, "decode"), got
                else:
                    assert got is None, f"prefill's engine port {port} is reachable: {got}"
            elif name.startswith("health") or name == "grpc-health":
                assert got == (np["healthFrom"] or None), (name, got)
            elif name.startswith("metrics"):
                assert got == np["metricsFrom"], (name, got)
            else:
                pytest.fail(f"{role} declares port {name}={port} that no policy rule decides")


def test_an_empty_frontend_closes_decode_instead_of_opening_it(chart):
    values = with_choice({"networkPolicy": {"frontend": []}, "tests": {"enabled": False}})
    objects = render(chart, values)
    policy = named(objects, "NetworkPolicy", f"{RELEASE}-deltakv-decode")
    assert sources(policy, chart.merge_values(values)["decode"]["port"]) is None
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])


def test_hostnetwork_install_is_warned_that_policies_do_not_apply(chart):
    notes = chart.render(values=values_of("mori-rdma"), name=RELEASE, namespace=NAMESPACE)
    text = next(t for p, t in notes.items() if p.endswith("NOTES.txt"))
    assert "NetworkPolicies do not apply to hostNetwork pods" in text


# --------------------------------------------------------------------------- TLS


def service_hosts(objects) -> set[str]:
    """DNS names the workers are dialed by: decode's --prefill-target and the test pod's
    --target (host part)."""
    hosts = set()
    for role, c, is_sidecar in workload_containers(objects):
        if role == "decode" and not is_sidecar:
            # dns:///NAME:PORT: decode dials every address NAME resolves to, checking NAME.
            target = flag_value(c["args"], "--prefill-target").removeprefix("dns:///")
            hosts.add(target.rsplit(":", 1)[0])
    for pod in of_kind(objects, "Pod"):
        hosts.add(flag_value(pod["spec"]["containers"][0]["args"], "--target").rsplit(":", 1)[0])
    return hosts


def tls_secret_names(objects) -> set[str]:
    pods = [deployment(objects, r)["spec"]["template"]["spec"] for r in ("prefill", "decode")]
    pods += [p["spec"] for p in of_kind(objects, "Pod")]
    return {v["secret"]["secretName"] for spec in pods for v in spec["volumes"]
            if v["name"] == "tls"}


def test_cert_manager_certificate_names_what_clients_dial_and_feeds_the_pods(rendered):
    values, objects = rendered["mooncake"]
    (cert,) = of_kind(objects, "Certificate")
    spec = cert["spec"]
    issuer = values["tls"]["certManager"]["issuerRef"]
    assert spec["issuerRef"] == {"name": issuer["name"], "kind": issuer["kind"],
                                 "group": "cert-manager.io"}
    assert service_hosts(objects) <= set(spec["dnsNames"])
    # Decode presents the same certificate to prefill, whose port requires client certs.
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert tls_secret_names(objects) == {spec["secretName"]} == {f"{RELEASE}-deltakv-tls"}
    assert (spec["duration"], spec["renewBefore"]) == (values["tls"]["certManager"]["duration"],
                                                       values["tls"]["certManager"]["renewBefore"])


@pytest.mark.parametrize("case", CASES)
def test_tls_comes_from_exactly_one_declared_source(case, rendered):
    values, objects = rendered[case]
    certs = of_kind(objects, "Certificate")
    if not values["tls"]["enabled"]:
        assert values["insecure"] and not certs and not tls_secret_names(objects)
        return
    if values["tls"]["certManager"]["issuerRef"]:
        assert len(certs) == 1
    else:
        assert not certs
        assert tls_secret_names(objects) == {values["tls"]["secretName"]}


# --------------------------------------------------------------------------- pairing key


def pairing_file(objects) -> str:
    files = {flag_value(c["args"], "--pairing-key-file")
             for _, c, _ in workload_containers(objects)}
    assert len(files) == 1, files
    return files.pop()


@pytest.mark.parametrize("case", CASES)
def test_every_process_reads_the_pairing_key_as_a_file_of_its_own_user(case, rendered):
    """The kubelet adds group read to a Secret volume's files when the pod has an fsGroup,
    whatever ``defaultMode`` says: a process mounting the Secret itself would read a 0440 key.
    So only the one-shot ``pairing-key`` init container mounts the Secret; it copies the key
    (``install -m 0400``: a file of runAsUser) into a memory emptyDir, which every
    long-running container mounts read-only."""
    values, objects = rendered[case]
    path = pairing_file(objects)
    secret_name = values["pairing"]["existingSecret"] or f"{RELEASE}-deltakv-pairing"
    key = values["pairing"]["existingSecretKey"] if values["pairing"]["existingSecret"] \
        else "pairing.key"
    for role in ("prefill", "decode"):
        spec = deployment(objects, role)["spec"]["template"]["spec"]
        assert spec["securityContext"].get("fsGroup") is not None  # why the copy is needed
        volumes = {v["name"]: v for v in spec["volumes"]}
        secret_volumes = {name for name, v in volumes.items()
                          if v.get("secret", {}).get("secretName") == secret_name}
        (init,) = one_shot_inits(spec)
        assert spec["initContainers"][0] is init, "the key must be in place before the sidecars"
        assert init["command"] == ["install"]
        mode_flag, source, target = init["args"][0:2], init["args"][2], init["args"][3]
        assert mode_flag == ["-m", "0400"] and target == path and len(init["args"]) == 4
        mounts = {m["name"]: m for m in init["volumeMounts"]}
        (secret_mount,) = [m for n, m in mounts.items() if n in secret_volumes]
        assert secret_mount["readOnly"] is True
        secret = volumes[secret_mount["name"]]["secret"]
        assert secret["items"] == [{"key": key, "path": source.removeprefix(
            secret_mount["mountPath"] + "/")}]
        (target_mount,) = [m for m in init["volumeMounts"]
                           if path.startswith(m["mountPath"] + "/")]
        assert not target_mount.get("readOnly")
        key_volume = volumes[target_mount["name"]]
        assert key_volume["emptyDir"]["medium"] == "Memory"  # never on the node's disk
        for c in [*native_sidecars(spec), *spec["containers"]]:
            (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert mount["name"] == target_mount["name"] and mount["readOnly"] is True
            # No long-running container sees the Secret's group-readable file.
            assert not {m["name"] for m in c["volumeMounts"]} & secret_volumes
    # The helm test pod is a client: it gets no pairing key.
    for pod in of_kind(objects, "Pod"):
        assert not {"pairing", "pairing-secret"} & {v["name"] for v in pod["spec"]["volumes"]}
    secrets = [s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == secret_name]
    if values["pairing"]["existingSecret"]:
        assert secrets == []
    else:
        (secret,) = secrets
        assert len(base64.b64decode(secret["data"]["pairing.key"], validate=True)) == 32


def test_the_generated_pairing_key_is_random_not_baked_into_the_chart(chart):
    keys = {named(render(chart, values_of("defaults")), "Secret",
                  f"{RELEASE}-deltakv-pairing")["data"]["pairing.key"] for _ in range(3)}
    assert len(keys) == 3
