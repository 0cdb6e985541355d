"""OpenAI request translation, usage, and error statuses (one mapping: gRPC code -> HTTP)."""

from __future__ import annotations

import json

import grpc
import pytest

from deltakv.errors import (
    HTTP_STATUS,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    http_status_of,
)
from deltakv.services.decode.prefill_pool import parse_targets
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
