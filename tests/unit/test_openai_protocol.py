"""OpenAI request translation, usage, and error statuses (one mapping: gRPC code -> HTTP)."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from deltakv.errors import (
    HTTP_STATUS,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    RequestTooLarge,
    ResourceExhausted,
    Unavailable,
    http_status_of,
)
from deltakv.services.decode.prefill_pool import parse_targets
from deltakv.services.model.sampling import Sampler
from deltakv.services.openai.app import error_response
from deltakv.services.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    usage_dict,
)
from deltakv.v1 import decode_pb2


def test_chat_request_becomes_one_generate_request() -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text",
                                                                           "text": "there"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "seed": 5,
        "stop": "\n\n", "ignore_eos": True, "unknown_field": 1})
    req = body.to_generate("rid")
    assert req.request_id == "rid" and req.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "be brief"),
                                                                 ("user", "hi there")]
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.seed, s.ignore_eos) == (7, 0.0, 5, True)
    assert list(req.stop) == ["\n\n"] and not req.disable_decode_prefix_reuse


def test_openai_defaults_and_completions_prompts() -> None:
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "x"}]}).to_generate("r")
    assert chat.sampling.temperature == 1.0 and chat.sampling.max_new_tokens == 0
    text = CompletionRequest.model_validate({"model": "m", "prompt": "abc"}).to_generate("r")
    assert text.text == "abc" and text.sampling.max_new_tokens == 16
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [5, 6],
                                            "disable_decode_prefix_reuse": True}
                                           ).to_generate("r")
    assert list(ids.token_ids.ids) == [5, 6] and ids.disable_decode_prefix_reuse


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True},
    {"model": "m", "messages": []},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
])
def test_unsupported_chat_options_are_invalid_argument(body) -> None:
    with pytest.raises(InvalidArgument):
        ChatCompletionRequest.model_validate(body).to_generate("r")


@pytest.mark.parametrize("body", [{"model": "m", "prompt": ["a", "b"]},
                                  {"model": "m", "prompt": "a", "echo": True}])
def test_unsupported_completion_options_are_invalid_argument(body) -> None:
    with pytest.raises(InvalidArgument):
        CompletionRequest.model_validate(body).to_generate("r")


def test_usage_has_the_standard_cached_tokens_and_the_deltakv_extension() -> None:
    u = usage_dict(decode_pb2.Usage(prompt_tokens=50, cached_tokens=32, completion_tokens=4,
                                    transferred_pages=2, transferred_bytes=65536, page_size=16,
                                    page_bytes=32768, request_id="r"))
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (50, 4, 54)
    assert u["prompt_tokens_details"] == {"cached_tokens": 32}
    assert u["deltakv"]["transferred_bytes"] == 65536 and u["deltakv"]["page_size"] == 16


@pytest.mark.parametrize("exc, status, kind", [
    (InvalidArgument("bad"), 400, "invalid_request_error"),
    (NotFound("no model"), 404, "not_found_error"),
    (ResourceExhausted("pool"), 429, "rate_limit_error"),
    (RequestTooLarge("needs 94 pages, the pool has 64"), 400, "invalid_request_error"),
    (Unavailable("prefill"), 503, "service_unavailable_error"),
    (DeadlineExceeded("slow"), 504, "timeout_error"),
    (RuntimeError("bug"), 500, "server_error"),
])
def test_error_shape_and_status(exc, status, kind) -> None:
    reply = error_response(exc)
    body = json.loads(reply.body)["error"]
    assert reply.status_code == status == http_status_of(exc)[0]
    assert body["type"] == kind and set(body) == {"message", "type", "param", "code"}


def test_every_grpc_code_has_an_http_status() -> None:
    assert set(HTTP_STATUS) == set(grpc.StatusCode)


def test_prefill_targets_parse() -> None:
    assert parse_targets(["a:1,b:2", "dns:///p.ns:3"]) == ["a:1", "b:2", "dns:///p.ns:3"]
    for bad in ([], ["a:1,"], [""]):
        with pytest.raises(InvalidArgument):
            parse_targets(bad)


def test_top_p_zero_keeps_only_the_most_likely_token() -> None:
    # OpenAI's top_p=0 is the tightest nucleus; deltakv's wire reads 0 as "unset" (1.0).
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0})
    params = body.sampling(8)
    assert 0.0 < params.top_p < 1e-6 and params.temperature == 1.0
    sampler = Sampler.from_proto(params)
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert {sampler.sample(logits) for _ in range(50)} == {1}


class _NoEngine:
    def generate(self, request):  # pragma: no cover - bodies are refused before
        raise AssertionError("not reached")

    async def cached_prefix(self, request):  # pragma: no cover
        raise AssertionError("not reached")


@pytest.mark.parametrize(("data", "headers", "expected"), [
    ('{"model":"m","messages":[{"role":"user"', {"Content-Type": "application/json"},
     "request body is not valid JSON (at character "),
    ("[]", {"Content-Type": "application/json"},
     "request body must be a JSON object (Content-Type: application/json)"),
    ("model=m", {"Content-Type": "application/x-www-form-urlencoded"},
     "request body must be a JSON object (Content-Type: application/json)"),
])
def test_malformed_bodies_get_a_plain_error(data, headers, expected) -> None:
    from fastapi.testclient import TestClient

    from deltakv.services.openai.app import create_app

    client = TestClient(create_app(_NoEngine(), "m"))
    reply = client.post("/v1/chat/completions", content=data, headers=headers)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["message"].startswith(expected) and error["param"] is None
    assert "File " not in error["message"] and "/" not in error["message"].split("(")[0]


@pytest.mark.parametrize("top_k, wire", [(-1, 0), (0, 0), (None, 0), (5, 5)])
def test_top_k_minus_one_and_zero_mean_off(top_k, wire) -> None:
    # vLLM's "off" is -1; deltakv's wire says off with 0.
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": top_k})
    assert body.sampling(8).top_k == wire


def test_top_k_below_minus_one_is_a_400_naming_top_k() -> None:
    from fastapi.testclient import TestClient

    from deltakv.services.openai.app import create_app

    reply = TestClient(create_app(_NoEngine(), "m")).post("/v1/completions", json={
        "model": "m", "prompt": "hi", "top_k": -2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_k"


@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/nope", 404, "not_found"),
    ("POST", "/v2/chat/completions", 404, "not_found"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
])
def test_unknown_paths_and_methods_answer_the_openai_error_shape(method, path, status,
                                                                 code) -> None:
    from fastapi.testclient import TestClient

    from deltakv.services.openai.app import create_app

    reply = TestClient(create_app(_NoEngine(), "m")).request(method, path)
    assert reply.status_code == status
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and path in body["error"]["message"]
    if status == 405:
        assert "POST" in reply.headers["allow"] or "GET" in reply.headers["allow"]


class _LengthLimitEngine:
    """Refuses every request as the decode service refuses a too-long max_new_tokens."""

    def generate(self, request):
        async def refuse():
            raise InvalidArgument(f"max_new_tokens={request.sampling.max_new_tokens} exceeds "
                                  f"the limit 4096", field="max_new_tokens")
            yield  # pragma: no cover - an async generator that raises at once

        return refuse()

    async def cached_prefix(self, request):  # pragma: no cover
        raise AssertionError("not reached")


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 5000}, "max_completion_tokens"),
])
def test_length_errors_name_the_api_field(path, body, field) -> None:
    from fastapi.testclient import TestClient

    from deltakv.services.openai.app import create_app

    reply = TestClient(create_app(_LengthLimitEngine(), "m")).post(path, json={"model": "m",
                                                                                **body})
    error = reply.json()["error"]
    assert reply.status_code == 400
    assert error["message"] == f"{field}=5000 exceeds the limit 4096"
    assert error["param"] == field and "max_new_tokens" not in error["message"]


def test_tenant_and_stall_fields_reach_the_generate_request() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "cache_salt": "tenant-1", "disable_chat_memory": True, "stall_timeout_ms": 2500}
    request = ChatCompletionRequest.model_validate(body).to_generate("r")
    assert request.cache_salt == "tenant-1" and request.disable_chat_memory
    assert request.stall_timeout_ms == 2500
    plain = CompletionRequest.model_validate({"model": "m", "prompt": "x"}).to_generate("r")
    assert plain.cache_salt == "" and not plain.disable_chat_memory
    assert plain.stall_timeout_ms == 0
    # vLLM: a cache_salt, when sent, is a non-empty string.
    for salt in ("", "x" * 257):
        with pytest.raises(ValueError, match="cache_salt"):
            ChatCompletionRequest.model_validate({**body, "cache_salt": salt})


def test_a_405_names_the_allowed_methods_and_sets_allow() -> None:
    from fastapi.testclient import TestClient

    from deltakv.services.openai.app import create_app

    client = TestClient(create_app(_NoEngine(), "m"))
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"),
                                  ("DELETE", "/v1/models", "GET"),
                                  ("PUT", "/v1/cache/match", "POST")):
        reply = client.request(method, path)
        assert reply.status_code == 405
        assert allowed in reply.headers["allow"].split(", ")
        message = reply.json()["error"]["message"]
        assert message.endswith(f"allowed: {reply.headers['allow']}") and "?" not in message


class _CachedPrefixEngine:
    """Says 16 of the prompt's tokens are cached; records what it was asked."""

    def __init__(self) -> None:
        self.asked = []

    def generate(self, request):  # pragma: no cover - not used by /v1/cache/match
        raise AssertionError("not reached")

    async def cached_prefix(self, request):
        self.asked.append(request)
        return 20, 16


@pytest.mark.parametrize("body, param, starts", [
    ({}, "model", "model: Field required"),
    ({"model": "m"}, "prompt", "prompt: Field required"),
    ({"model": "m", "messages": "hi"}, "messages", "messages: "),
    ([1], None, "request body must be a JSON object"),
    ('{"model":', None, "request body is not valid JSON (at character "),
])
def test_cache_match_refuses_a_bad_body_in_the_openai_shape(body, param, starts) -> None:
    from fastapi.testclient import TestClient

    from deltakv.services.openai.app import create_app

    engine = _CachedPrefixEngine()
    client = TestClient(create_app(engine, "m"))
    content = body if isinstance(body, str) else json.dumps(body)
    reply = client.post("/v1/cache/match", content=content,
                        headers={"Content-Type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_argument"
    assert error["param"] == param and error["message"].startswith(starts)
    assert "input_value" not in error["message"] and "pydantic" not in error["message"]
    assert engine.asked == []


def test_cache_match_answers_for_the_served_model_and_404s_another() -> None:
    from fastapi.testclient import TestClient

    from deltakv.services.openai.app import create_app

    engine = _CachedPrefixEngine()
    client = TestClient(create_app(engine, "m"))
    reply = client.post("/v1/cache/match", json={"model": "other", "prompt": "hi"})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["param"] == "model" and "`other`" in error["message"]
    assert engine.asked == []
    reply = client.post("/v1/cache/match", json={"model": "m", "prompt": "hi"})
    assert reply.status_code == 200
    assert reply.json() == {"model": "m", "prompt_tokens": 20, "cached_tokens": 16}
