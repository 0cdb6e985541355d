"""Rendering the Helm chart (helm/deltakv) offline for tests, and reading rendered objects.

Helm's own Go code renders in-process (``helm_python``). The cases are the chart's defaults and
every shipped ``helm/deltakv/ci/*-values.yaml``. The defaults alone do not render, by design
(TLS is on and needs a certificate), so the "defaults" case is values.yaml plus the one choice
it leaves open: an existing certificate Secret (:data:`DEFAULTS_CHOICE`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "deltakv"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CASES = ["defaults", *(p.name.removesuffix("-values.yaml") for p in CI_VALUES)]
# Native sidecars are GA in 1.33, DRA (resource.k8s.io/v1) in 1.34: validate against 1.34.
KUBE_VERSION = "1.34.0"
RELEASE, NAMESPACE = "demo", "ml"
#: What values.yaml leaves for the installer to choose: where the TLS certificate comes from.
DEFAULTS_CHOICE: dict[str, Any] = {"tls": {"secretName": "deltakv-tls"}}


def values_of(case: str) -> dict[str, Any]:
    """The values a case installs with (a fresh copy)."""
    if case == "defaults":
        return yaml.safe_load(yaml.safe_dump(DEFAULTS_CHOICE))
    return yaml.safe_load((CHART / "ci" / f"{case}-values.yaml").read_text())


def render(chart: Any, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Rendered Kubernetes objects (NOTES.txt and empty documents dropped)."""
    manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def deployment(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return named(objects, "Deployment", f"{RELEASE}-deltakv-{role}")


def flag_values(args: list[str], flag: str) -> list[str]:
    """Values following every occurrence of ``flag`` in an argv list."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def flag_value(args: list[str], flag: str) -> str:
    values = flag_values(args, flag)
    assert len(values) == 1, f"{flag} appears {len(values)} times in {args}"
    return values[0]


def ports_by_name(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def native_sidecars(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A pod spec's native sidecars (init containers with ``restartPolicy: Always``), in rank
    order; the one-shot init containers before them (the pairing key's copy) are left out."""
    return [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]


def one_shot_inits(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A pod spec's init containers that run to completion before the sidecars start."""
    return [c for c in spec.get("initContainers", []) if c.get("restartPolicy") != "Always"]


def workload_containers(objects: list[dict[str, Any]]):
    """(deployment role, container, is_sidecar) for every long-running deltakv container of
    both pools (native sidecars and workers)."""
    for role in ("prefill", "decode"):
        spec = deployment(objects, role)["spec"]["template"]["spec"]
        for c in native_sidecars(spec):
            yield role, c, True
        for c in spec["containers"]:
            yield role, c, False


def leaf_parser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The subparser for ``words`` (e.g. ["serve", "decode"]); AssertionError naming what is
    missing."""
    current = parser
    for depth, word in enumerate(words):
        subparsers = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        choices = subparsers[0].choices if subparsers else {}
        assert word in choices, (f"`deltakv {' '.join(words[:depth + 1])}` is not in the CLI "
                                 f"(deltakv.services.cli.main.build_parser()); the chart "
                                 f"renders it")
        current = choices[word]
    return current


def with_choice(values: dict[str, Any] | None) -> dict[str, Any]:
    """``values`` on top of :data:`DEFAULTS_CHOICE` (a deep merge; ``values`` wins)."""
    return deep_merge(values_of("defaults"), values or {})


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class StrictValidationError(AssertionError):
    """A rendered object does not validate strictly (unknown fields included)."""


def validate_strictly(obj: dict[str, Any]) -> None:
    """Validate one rendered object in strict mode; StrictValidationError naming the problem.

    Kubernetes' own kinds: the OpenAPI schemas bundled in ``kubernetes_validate`` (strict:
    unknown fields rejected). The Gateway API kinds (InferencePool, HTTPRoute): the strict
    schemas of :mod:`tests.support.crd_schemas`. cert-manager's ``Certificate`` is a CRD those schemas lack: it is
    validated by the models ``cloudcoil-models-cert-manager`` generates from cert-manager's own
    CRD schemas, and must round-trip through them unchanged — the models ignore unknown fields,
    so a field they drop is one cert-manager would reject.
    """
    import jsonschema
    import kubernetes_validate

    from tests.support.crd_schemas import SCHEMAS as CRD_SCHEMAS

    crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if crd is not None:
        try:
            jsonschema.validate(obj, crd)
        except jsonschema.ValidationError as exc:
            raise StrictValidationError(f"{exc.message} at {list(exc.absolute_path)}") from None
        return
    if obj.get("apiVersion", "").startswith("cert-manager.io/"):
        from cloudcoil.models.cert_manager import v1 as cert_manager
        from pydantic import ValidationError

        model = getattr(cert_manager, obj["kind"], None)
        if model is None:
            raise StrictValidationError(f"cert-manager has no kind {obj['kind']!r}")
        try:
            parsed = model.model_validate(obj)
        except ValidationError as exc:
            raise StrictValidationError(str(exc)) from None
        echoed = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
        if echoed != obj:
            raise StrictValidationError(
                f"{obj['kind']} has fields cert-manager does not know: rendered "
                f"{json_dumps(obj)}, understood {json_dumps(echoed)}")
        return
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise StrictValidationError(f"{exc.message} at {list(exc.absolute_path)}") from None


def json_dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, sort_keys=True)
