"""Strict JSON schemas of the custom resources the chart can render, for offline validation.

kubernetes-validate bundles only the built-in kinds. These schemas are written from the
documented v1 APIs — Gateway API Inference Extension ``InferencePool``
(inference.networking.k8s.io/v1: ``spec.selector.matchLabels``, one ``spec.targetPorts[].number``,
``spec.endpointPickerRef{name, kind, port.number, failureMode}``) and Gateway API ``HTTPRoute``
(gateway.networking.k8s.io/v1, the fields the chart uses) — with unknown fields rejected, like
kubernetes-validate's strict mode.
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": _NAME, "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object"}}, "additionalProperties": False}


def _strict(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


INFERENCE_POOL = _strict({
    "apiVersion": {"const": "inference.networking.k8s.io/v1"},
    "kind": {"const": "InferencePool"},
    "metadata": _META,
    "spec": _strict({
        "selector": _strict({"matchLabels": {
            "type": "object", "minProperties": 1,
            "additionalProperties": {"type": "string", "maxLength": 63}}}, ["matchLabels"]),
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1,
                        "items": _strict({"number": _PORT}, ["number"])},
        "endpointPickerRef": _strict({
            "group": {"type": "string"}, "kind": {"type": "string", "minLength": 1},
            "name": _NAME, "port": _strict({"number": _PORT}, ["number"]),
            "failureMode": {"enum": ["FailOpen", "FailClose"]}}, ["name"]),
    }, ["selector", "targetPorts", "endpointPickerRef"]),
}, ["apiVersion", "kind", "metadata", "spec"])

HTTP_ROUTE = _strict({
    "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
    "kind": {"const": "HTTPRoute"},
    "metadata": _META,
    "spec": _strict({
        "parentRefs": {"type": "array", "minItems": 1, "items": _strict({
            "name": _NAME, "namespace": {"type": "string"}, "sectionName": {"type": "string"}},
            ["name"])},
        "rules": {"type": "array", "minItems": 1, "items": _strict({
            "matches": {"type": "array", "items": _strict({"path": _strict({
                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                "value": {"type": "string"}}, ["type", "value"])}, [])},
            "backendRefs": {"type": "array", "items": _strict({
                "group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                "port": _PORT, "weight": {"type": "integer"}}, ["name"])},
            "timeouts": _strict({"request": {"type": "string"},
                                 "backendRequest": {"type": "string"}}, []),
        }, [])},
    }, ["parentRefs", "rules"]),
}, ["apiVersion", "kind", "metadata", "spec"])

#: (apiVersion, kind) -> schema
SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
           ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE}
