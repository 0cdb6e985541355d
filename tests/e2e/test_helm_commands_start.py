"""The chart's rendered commands really start: every shipped values file, every pod, for real.

For the chart's defaults and each ``helm/deltakv/ci/*-values.yaml`` the chart is rendered
offline and each pool's pod is run on this machine the way the kubelet would run it: the
sidecar container's and the worker's ``command`` + ``args`` with the container's own ``env``
(``$(VAR)`` references expanded by Kubernetes' rules), native sidecar first, each waited for
on the port its rendered readiness probe names; then the rendered ``helm test`` pod runs its
two-turn check against decode; then the pods are stopped (SIGTERM, worker before sidecar) and
every process must exit 0. An argument or an environment value a binary refuses fails here.

Only what cannot exist on one machine is substituted, each in one place below:

* the downward API: ``POD_IP`` -> 127.0.0.1, ``POD_NAME`` -> a unique name;
* the pod network: every pod has its own network namespace, here they share one, so each pod's
  ports are moved to free local ones (the engine port block to a free contiguous block below
  32768, where Mooncake accepts it) and a Service DNS name -> 127.0.0.1 and the mapped port of its target pod;
* volumes: emptyDirs -> temporary directories; Secrets -> test files with the modes the
  kubelet gives them (TLS: tests/tls_certs.py's PKI; the pairing key: 32 random bytes); the
  test pod's ConfigMap -> its rendered content; the hostPath ``/dev/shm`` stays the node's;
* the OTLP collector's DNS name -> a local OTLP receiver (tests/otlp_receiver.py, in its own
  process);
* MORI-IO (ROCm only) -> the labelled stand-in in tests/standins, as in test_mori_cluster.py;
* the model -> ``tiny-random``: loading SmolLM2 takes ~40 s per worker on 2 cores, eight of
  them would blow this test's budget; the SmolLM2 e2e tests start the same ``--model smollm2``
  flags, and :func:`test_every_named_model_resolves` resolves each model name the values give;
* pool sizes -> at most 256 pages: the values size pools for production nodes (the mori-rdma
  values alone would take 6 GiB of this machine's /dev/shm);

All pods of all cases start together (ports and names never collide), so the test costs about
one cluster start plus the CPU of 20 small processes (~1-2 minutes on 2 busy cores);
``DELTAKV_HELM_CASES=shm-cpu`` (comma-separated names) starts only those. Decode's OpenAI HTTP
API is checked too: HTTPS as the values say (client certificates with tls.requireClientCert),
plain HTTP refused. The affinity router (Envoy) is not started: no Envoy binary here; its
rendered configuration is checked offline (tests/unit/test_helm_routing.py).
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import pytest

from deltakv.services.process import ManagedProcess, ProcessError
from tests.support.helm import (
    CASES,
    CHART,
    NAMESPACE,
    RELEASE,
    deployment,
    named,
    native_sidecars,
    of_kind,
    one_shot_inits,
    render,
    values_of,
)
from tests.tls_certs import make_pki

pytestmark = [pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
DELTAKV = str(Path(sys.executable).parent / "deltakv")  # the console script the image runs
START_TIMEOUT_S = 240.0
# Pools are sized for production nodes (mori-rdma: 131072 pages per decode sidecar, 4 GiB of
# /dev/shm even with the tiny model); ten of them at once do not fit one test machine.
MAX_PAGES = 256
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command, args and env values: a defined variable
    is replaced, ``$$`` is a literal ``$``, an undefined reference stays as written."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, text)


_TAKEN: set[int] = set()


def free_block(n: int = 1) -> int:
    """P with P .. P + n - 1 free now and handed out to no other pod of this test: below
    Linux's ephemeral range 32768-60999, so no client socket takes them meanwhile (and
    Mooncake accepts them)."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000)
        block = set(range(base, base + n))
        if block & _TAKEN:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for p in block:
                    s = stack.enter_context(socket.socket())
                    s.bind(("0.0.0.0", p))
            except OSError:
                continue
        _TAKEN.update(block)
        return base
    raise AssertionError(f"no {n} free adjacent ports below 32000")


def secret_mode(volume: dict[str, Any], pod_spec: dict[str, Any]) -> int:
    """File mode the kubelet gives a Secret/ConfigMap volume's files: ``defaultMode``, plus
    group read when the pod has an ``fsGroup`` (the kubelet's volume ownership rule)."""
    source = volume.get("secret") or volume.get("configMap")
    mode = source.get("defaultMode", 0o644)
    if pod_spec.get("securityContext", {}).get("fsGroup") is not None:
        mode |= 0o440
    return mode


@dataclass
class Pod:
    """One rendered pod run as local processes: its containers, in kubelet order."""

    name: str
    role: str
    spec: dict[str, Any]
    ports: dict[int, int] = field(default_factory=dict)  # rendered port -> local port
    mounts: dict[str, str] = field(default_factory=dict)  # volume name -> local directory
    procs: list[ManagedProcess] = field(default_factory=list)


class Case:
    """One values file: its rendered objects, turned into local pods."""

    def __init__(self, name: str, values: dict[str, Any], objects: list[dict[str, Any]],
                 workdir: Path, fixtures: dict[str, Any]) -> None:
        self.name, self.values, self.objects = name, values, objects
        self.workdir = workdir
        self.fixtures = fixtures
        self.substituted_model: str | None = None
        self.tag = secrets.token_hex(3)
        self.secrets: dict[str, dict[str, bytes]] = {}
        self.pods = {role: self._pod(role) for role in ("prefill", "decode")}

    # -- substitution ------------------------------------------------------------------------

    def _pod(self, role: str) -> Pod:
        spec = deployment(self.objects, role)["spec"]["template"]["spec"]
        pod = Pod(f"{RELEASE}-{role}-{self.name}-{self.tag}", role, spec)
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        engine = [p["containerPort"] for c in containers for p in c.get("ports", [])
                  if p["name"].startswith("xfer-")]
        if engine:  # the engine port block stays contiguous (the sidecar gets its first port)
            base = free_block(max(engine) - min(engine) + 1)
            pod.ports.update({p: base + p - min(engine) for p in engine})
        for c in containers:
            for p in c.get("ports", []):
                pod.ports.setdefault(p["containerPort"], free_block())
        for volume in spec["volumes"]:
            pod.mounts[volume["name"]] = self._volume(pod, volume)
        return pod

    def _volume(self, pod: Pod, volume: dict[str, Any]) -> str:
        if "hostPath" in volume:
            return volume["hostPath"]["path"]  # /dev/shm: the node's, as on the node
        # Socket paths must stay under 107 bytes: short directories directly under /tmp.
        local = Path(tempfile.mkdtemp(prefix=f"dkv-{volume['name'][:4]}-", dir=self.workdir))
        if "emptyDir" in volume:
            return str(local)
        mode = secret_mode(volume, pod.spec)
        if "secret" in volume:
            name = volume["secret"]["secretName"]
            data = self._secret_data(name)
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
        else:
            name = volume["configMap"]["name"]
            data = {k: v.encode() for k, v in
                    named(self.objects, "ConfigMap", name)["data"].items()}
            items = [{"key": k, "path": k} for k in data]
        for item in items:
            path = local / item["path"]
            path.write_bytes(data[item["key"]])
            path.chmod(mode)
        return str(local)

    def _secret_data(self, name: str) -> dict[str, bytes]:
        """A Secret's files, the same for every pod of the case: the rendered one's data if
        the chart made it, else the test stand-in for a Secret the installer provides (TLS
        PKI, a pairing key)."""
        if name not in self.secrets:
            self.secrets[name] = self._make_secret_data(name)
        return self.secrets[name]

    def _make_secret_data(self, name: str) -> dict[str, bytes]:
        for s in of_kind(self.objects, "Secret"):
            if s["metadata"]["name"] == name:
                return {k: base64.b64decode(v) for k, v in s["data"].items()}
        pki = self.fixtures["pki"]
        if name == self.values["pairing"]["existingSecret"]:
            return {self.values["pairing"]["existingSecretKey"]: secrets.token_bytes(32)}
        # The TLS Secret: an existing one, or the one cert-manager writes for the Certificate.
        return {"tls.crt": pki.server.cert.read_bytes(), "tls.key": pki.server.key.read_bytes(),
                "ca.crt": pki.ca.read_bytes()}

    def _env(self, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
        downward = {"status.podIP": "127.0.0.1", "metadata.name": pod.name,
                    "metadata.namespace": NAMESPACE}
        env: dict[str, str] = {}
        for e in container.get("env", []):
            if "valueFrom" in e:
                env[e["name"]] = downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                env[e["name"]] = expand(e["value"], env)
        env = {k: self._local_path(pod, container, v) for k, v in env.items()}
        if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.fixtures["otlp"]
        if self.values["transport"]["backend"] == "mori" and not self.fixtures["mori_real"]:
            env["PYTHONPATH"] = str(REPO / "tests" / "standins")
        base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        return {**base, **env}

    @staticmethod
    def _local_path(pod: Pod, container: dict[str, Any], text: str) -> str:
        for m in sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
            root = m["mountPath"].rstrip("/")
            if text == root or text.startswith(root + "/"):
                return pod.mounts[m["name"]] + text[len(root):]
        return text

    def _target(self, text: str) -> str:
        """``[dns:///]<service>.<ns>.svc.<domain>:<port>`` -> ``127.0.0.1:<local port of its
        pod>`` (one pod per role here: what the name resolves to)."""
        host, _, port = text.removeprefix("dns:///").rpartition(":")
        service = named(self.objects, "Service", host.split(".")[0])
        (sp,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        role = service["spec"]["selector"]["app.kubernetes.io/component"]
        pod = self.pods[role]
        containers = [*pod.spec.get("initContainers", []), *pod.spec["containers"]]
        (target,) = [p["containerPort"] for c in containers for p in c.get("ports", [])
                     if p["name"] == sp["targetPort"]]
        return f"127.0.0.1:{pod.ports[target]}"

    def argv(self, pod: Pod, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        args = [expand(a, env) for a in container["args"]]
        args = [self._local_path(pod, container, a) for a in args]
        out = []
        for i, a in enumerate(args):
            prev = args[i - 1] if i else ""
            if prev in ("--port", "--http-port", "--health-port", "--metrics-port") and \
                    int(a) in pod.ports:
                a = str(pod.ports[int(a)])
            elif prev in ("--prefill-target", "--target"):
                a = self._target(a)
            elif prev == "--model" and a != "tiny-random":
                self.substituted_model, a = a, "tiny-random"
            elif prev == "--num-pages" and int(a) > MAX_PAGES:
                a = str(MAX_PAGES)
            out.append(a)
        if container["command"] == ["deltakv"]:
            return [DELTAKV, *out]
        command = [self._local_path(pod, container, c) for c in container["command"]]
        return [sys.executable if command[0] == "python" else command[0], *command[1:], *out]

    def process(self, pod: Pod, container: dict[str, Any]) -> ManagedProcess:
        env = self._env(pod, container)
        argv = self.argv(pod, container, env)
        probe = container["readinessProbe"]["grpc"]["port"]
        return ManagedProcess(f"{self.name}/{pod.role}/{container['name']}", argv,
                              self.workdir / f"{pod.role}-{container['name']}.log",
                              health_target=f"127.0.0.1:{pod.ports[probe]}", env=env,
                              cwd=pod.mounts.get("tmp"), stop_timeout_s=60.0)

    # -- running ------------------------------------------------------------------------------

    def run_one_shot_inits(self) -> list[str]:
        """Run each pod's one-shot init containers to completion, in order, as the kubelet
        does before it starts the native sidecars; what failed (empty: all exited 0)."""
        failures = []
        for pod in self.pods.values():
            for c in one_shot_inits(pod.spec):
                env = self._env(pod, c)
                done = subprocess.run(self.argv(pod, c, env), env=env, capture_output=True,
                                      text=True, timeout=60, cwd=pod.mounts.get("tmp"))
                if done.returncode != 0:
                    failures.append(f"{self.name}/{pod.role}/{c['name']} exited "
                                    f"{done.returncode}: {done.stderr[-2000:]}")
        return failures

    def start_sidecars(self) -> None:
        for pod in self.pods.values():
            for c in native_sidecars(pod.spec):
                pod.procs.append(self.process(pod, c).start())

    def start_workers(self) -> None:
        for pod in self.pods.values():
            for c in pod.spec["containers"]:
                pod.procs.append(self.process(pod, c).start())

    def helm_test(self) -> ManagedProcess:
        (test_pod,) = of_kind(self.objects, "Pod")
        pod = Pod(f"{RELEASE}-test-{self.name}", "test", test_pod["spec"])
        pod.mounts = {v["name"]: self._volume(pod, v) for v in test_pod["spec"]["volumes"]}
        (container,) = test_pod["spec"]["containers"]
        env = self._env(pod, container)
        return ManagedProcess(f"{self.name}/helm-test", self.argv(pod, container, env),
                              self.workdir / "helm-test.log", env=env).start()

    def check_http_api(self) -> str | None:
        """What is wrong with decode's OpenAI HTTP API as rendered (None if nothing, or if the
        values turn it off): /v1/models answers over HTTPS when TLS is on — with the client
        certificate only when tls.requireClientCert — and refuses plain HTTP; over plain HTTP
        when TLS is off."""
        import httpx

        worker = self.pods["decode"].spec["containers"][0]
        rendered = [p["containerPort"] for p in worker.get("ports", []) if p["name"] == "http"]
        if not rendered:
            return None
        address = f"127.0.0.1:{self.pods['decode'].ports[rendered[0]]}"
        tls = self.values["tls"]
        pki = self.fixtures["pki"]
        try:
            if not tls["enabled"]:
                response = httpx.get(f"http://{address}/v1/models", timeout=10.0)
            else:
                trust = ssl.create_default_context(cafile=str(pki.ca))
                if tls["requireClientCert"]:
                    with contextlib.suppress(httpx.HTTPError):
                        httpx.get(f"https://{address}/v1/models", verify=trust, timeout=10.0)
                        return "decode's HTTPS API answered a client without a certificate"
                    trust.load_cert_chain(str(pki.client.cert), str(pki.client.key))
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(f"http://{address}/v1/models", timeout=10.0)
                    return "decode's HTTP API answered plain HTTP with TLS on"
                response = httpx.get(f"https://{address}/v1/models", verify=trust, timeout=10.0)
        except httpx.HTTPError as exc:
            return f"decode's HTTP API at {address}: {type(exc).__name__}: {exc}"
        if response.status_code != 200 or not response.json().get("data"):
            return f"decode's HTTP API /v1/models: {response.status_code} {response.text[:200]}"
        return None

    def processes(self, kind: str) -> list[ManagedProcess]:
        """This case's running ``worker`` or ``sidecar`` processes."""
        return [proc for pod in self.pods.values() for proc in pod.procs
                if proc.name.split("/")[-1].startswith(kind)]

    def cleanup(self) -> None:
        """Stop whatever still runs (SIGTERM, so sidecars unlink their pools; SIGKILL after
        a bound) and remove what a killed process leaves in the shared /dev/shm: pool
        segments named after the pod or derived from the socket path, and the MORI-IO
        stand-in's per-process tables."""
        from deltakv.sidecar.server import default_shm_name

        for pod in self.pods.values():
            for kind in ("worker", "sidecar"):
                for proc in pod.procs:
                    if proc.name.split("/")[-1].startswith(kind):
                        proc.stop(signal.SIGTERM, timeout_s=20.0)
            patterns = [f"deltakv-{pod.name}-*"]
            for c in native_sidecars(pod.spec):
                socket_path = self._local_path(pod, c, c["args"][c["args"].index("--socket") + 1])
                patterns.append(default_shm_name(socket_path) + "*")
            patterns += [f"mori-standin-*-{proc.pid}" for proc in pod.procs if proc.pid]
            for pattern in patterns:
                for leftover in Path("/dev/shm").glob(pattern):
                    leftover.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Iterator[dict[str, Any]]:
    from deltakv.sidecar.transport.registry import unavailable_reason

    with otlp_receiver() as endpoint:
        yield {"pki": make_pki(tmp_path_factory.mktemp("pki")), "otlp": endpoint,
               "mori_real": unavailable_reason("mori") is None}


# The collector stand-in runs in its own process: a gRPC server busy in this one would make
# every fork below race gRPC's fork handlers (the child aborts in epoll_wait before exec).
_RECEIVER = """
import sys
from tests.otlp_receiver import OtlpReceiver
with OtlpReceiver() as receiver:
    print(receiver.endpoint, flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def otlp_receiver() -> Iterator[str]:
    """The endpoint of a local OTLP receiver (tests/otlp_receiver.py) in a child process,
    stopped when its stdin closes."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://"), f"OTLP receiver did not start ({endpoint!r})"
        yield endpoint
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def selected_cases() -> list[str]:
    """Every case, or those named in ``$DELTAKV_HELM_CASES`` (comma-separated, e.g.
    ``shm-cpu``): one values file at a time fits a machine shared with other work."""
    wanted = [c for c in os.environ.get("DELTAKV_HELM_CASES", "").split(",") if c]
    unknown = sorted(set(wanted) - set(CASES))
    assert not unknown, f"DELTAKV_HELM_CASES names no case {unknown}; cases: {CASES}"
    return wanted or list(CASES)


def needs_missing_cuda(name: str) -> bool:
    """True for a values file whose pools live in GPU memory while this machine has no CUDA:
    its commands must fail fast instead (:func:`test_gpu_values_fail_fast_without_cuda`)."""
    from deltakv.sidecar.device.cuda import CudaDevice

    accelerator = values_of(name).get("accelerator", {})
    return accelerator.get("kvPoolDevice") == "cuda" and CudaDevice.probe(0) is not None


@pytest.fixture(scope="module")
def cases(fixtures) -> Iterator[list[Case]]:
    root = Path(tempfile.mkdtemp(prefix="dkv-chart-", dir="/tmp"))
    built: list[Case] = []
    try:
        with helm_python.Chart.load(CHART) as chart:
            for name in [c for c in selected_cases() if not needs_missing_cuda(c)]:
                values = values_of(name)
                workdir = root / name
                workdir.mkdir()
                built.append(Case(name, chart.merge_values(values), render(chart, values),
                                  workdir, fixtures))
        yield built
    finally:
        for case in built:
            case.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def test_every_rendered_command_starts_serves_and_stops_cleanly(cases: list[Case]) -> None:
    # The kubelet starts a pod's native sidecar, waits for its startup probe, then the worker;
    # pods start independently (decode's worker waits for prefill by itself). All cases at once.
    init_failures = [f for case in cases for f in case.run_one_shot_inits()]
    assert not init_failures, "\n".join(init_failures)
    for case in cases:
        case.start_sidecars()
    _wait_all([p for c in cases for pod in c.pods.values() for p in pod.procs])
    for case in cases:
        case.start_workers()
    _wait_all([p for c in cases for pod in c.pods.values() for p in pod.procs])
    tests = {case.name: case.helm_test() for case in cases}
    failures = []
    for name, proc in tests.items():
        try:
            code = proc.wait(START_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - reported with its log below
            proc.kill()
            code = None
        if code != 0:
            failures.append(f"{name}: helm test exited {code}\n{proc.log_tail(30)}")
    failures += [f"{case.name}: {problem}" for case in cases
                 if (problem := case.check_http_api()) is not None]
    # Model workers keep freed memory mapped (services/model/host_memory.py): as rendered,
    # each decode and prefill worker logged that the setting took effect.
    failures += [f"{proc.name}: no host_malloc keep_freed_memory=true at start-up"
                 for case in cases for proc in case.processes("worker")
                 if '"event": "host_malloc"' not in (text := proc.log_text())
                 or '"keep_freed_memory": true' not in text]
    # Every process reads the pairing key as a file of its own user, mode 0400, so none warns
    # that it is readable by others (the warning is for a key that really is).
    failures += [f"{proc.name}: warned pairing_key_file_readable_by_others"
                 for case in cases for kind in ("worker", "sidecar")
                 for proc in case.processes(kind)
                 if "pairing_key_file_readable_by_others" in proc.log_text()]
    # Workers first, then sidecars (the kubelet's order), every pod at once.
    for kind in ("worker", "sidecar"):
        procs = [proc for case in cases for proc in case.processes(kind)]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:  # one SIGTERM only: a second one asks the lifecycle to give up the drain
                code = proc.wait(60.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = None
            if code != 0:
                failures.append(f"{proc.name} exited {code} on SIGTERM\n{proc.log_tail()}")
    assert not failures, "\n".join(failures)


def _wait_all(procs: list[ManagedProcess]) -> None:
    errors = []
    for proc in procs:
        try:
            proc.wait_serving(START_TIMEOUT_S)
        except ProcessError as exc:
            errors.append(str(exc))
    assert not errors, "\n\n".join(errors)


def test_gpu_values_fail_fast_without_cuda(fixtures) -> None:
    """Without CUDA, every sidecar and worker of a GPU-pool values file exits 1 at start-up
    with one line naming CUDA, and none serves."""
    names = [c for c in selected_cases() if needs_missing_cuda(c)]
    if not names:
        pytest.skip("no GPU-pool values file selected, or CUDA is present")
    root = Path(tempfile.mkdtemp(prefix="dkv-chart-gpu-", dir="/tmp"))
    failures = []
    try:
        with helm_python.Chart.load(CHART) as chart:
            for name in names:
                values = values_of(name)
                (root / name).mkdir()
                case = Case(name, chart.merge_values(values), render(chart, values),
                            root / name, fixtures)
                try:
                    # The pairing key reaches the containers through a one-shot init container,
                    # as in the chart's other pods: run it first, so that CUDA is what fails.
                    init_failures = case.run_one_shot_inits()
                    assert not init_failures, "\n".join(init_failures)
                    case.start_sidecars()
                    case.start_workers()
                    procs = case.processes("sidecar") + case.processes("worker")
                    assert len(procs) == 4, [p.name for p in procs]  # 2 pods x (sidecar, worker)
                    for proc in procs:
                        code = proc.wait(120)
                        lines = [ln for ln in proc.log_text().splitlines() if "CUDA" in ln]
                        if code != 1 or len(lines) != 1:
                            failures.append(f"{proc.name}: exit {code}, CUDA lines {lines}\n"
                                            f"{proc.log_tail()}")
                finally:
                    case.cleanup()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert not failures, "\n".join(failures)


def test_every_named_model_resolves() -> None:
    """The model names the values give (replaced by tiny-random above) are ones the loader
    knows: their geometry and fingerprint resolve as a sidecar's ``--model`` would."""
    from deltakv.services.model.loader import kv_geometry

    with helm_python.Chart.load(CHART) as chart:
        names = {chart.merge_values(values_of(case))["model"]["name"] for case in CASES}
    for name in sorted(names):
        geometry = kv_geometry(name)
        assert geometry.num_layers > 0 and geometry.fingerprint, name
