"""The OpenAI-compatible HTTP API of a real local cluster (tiny-random, geometry T), driven by
the official ``openai`` client (streaming and not), by ``curl``, and by ``bench multiturn --api
openai``: text chat reuses every full page of the previous turn, exactly like token ids."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import openai
import pytest

from deltakv.client import DecodeClient
from deltakv.services.cli.bench.multiturn import INCREMENTAL, MultiturnConfig, run_multiturn
from tests.e2e.conftest import TOY_PAGE_SIZE, make_cluster, run, wait_for_baseline

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "openai-api", http_port=0, num_pages=256)
    try:
        yield c
    finally:
        c.stop()


def _reusable(prompt_tokens: int, completion_tokens: int) -> int:
    return (prompt_tokens + completion_tokens - 1) // TOY_PAGE_SIZE * TOY_PAGE_SIZE


def test_models_and_health(client, cluster) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"http://{cluster.http_address}/health").status_code == 200


def test_text_chat_turns_reuse_every_full_page(client) -> None:
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Tell me about the sea, the wind and the rain."}]
    previous = None
    for turn in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                               temperature=0, extra_body={"ignore_eos": True})
        usage = reply.usage
        assert reply.choices[0].finish_reason == "length" and usage.completion_tokens == 24
        cached = usage.prompt_tokens_details.cached_tokens
        if previous is None:
            assert cached == 0
        else:  # all full pages of the previous prompt + answer, as with token ids
            assert cached == _reusable(*previous)
        extra = usage.model_extra["deltakv"]
        pages = -(-usage.prompt_tokens // TOY_PAGE_SIZE) - cached // TOY_PAGE_SIZE
        assert extra["transferred_bytes"] == pages * extra["page_bytes"]
        previous = (usage.prompt_tokens, usage.completion_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And question {turn}?"}]


def test_streaming_equals_non_streaming_and_the_grpc_path(client, cluster) -> None:
    prompt = [{"role": "user", "content": "Count the stars, slowly, one by one."}]
    whole = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=16,
                                           temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again

    async def grpc_twin():
        async with DecodeClient(cluster.decode_address, timeout_s=60) as c:
            return await c.generate(chat=prompt, max_new_tokens=16)
    assert run(grpc_twin()).text == text  # one request path, one answer


def test_completions_with_token_ids_and_stop_string(client) -> None:
    first = client.completions.create(model=MODEL, prompt=[3 + b for b in b"abc abc abc"],
                                      max_tokens=12, temperature=0)
    text = first.choices[0].text
    assert first.usage.prompt_tokens == 11 and first.usage.completion_tokens == 12
    if len(text) > 4:
        stop = text[2:4]
        cut = client.completions.create(model=MODEL, prompt=[3 + b for b in b"abc abc abc"],
                                        max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_errors_have_openai_shape_and_status(client, cluster) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user",
                                                                  "content": "x"}])
    assert err.value.body["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, n=2, messages=[{"role": "user",
                                                                    "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    reply = httpx.post(f"http://{cluster.http_address}/v1/chat/completions",
                       json={"model": MODEL, "messages": "nope"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_argument"
    with pytest.raises(openai.BadRequestError, match="context"):  # past the model's positions
        client.completions.create(model=MODEL, prompt="x" * 9000, max_tokens=4)


def test_curl_streaming_and_not(cluster) -> None:
    url = f"http://{cluster.http_address}/v1/chat/completions"
    body = json.dumps({"model": MODEL, "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "hi"}]})
    out = subprocess.run(["curl", "-sS", "--fail-with-body", url, "-H",
                          "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout)["usage"]["completion_tokens"] == 8
    stream_body = json.dumps({**json.loads(body), "stream": True})
    out = subprocess.run(["curl", "-sSN", "--fail-with-body", url, "-H",
                          "Content-Type: application/json", "-d", stream_body],
                         capture_output=True, text=True, timeout=60, check=True)
    events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_client_disconnect_mid_stream_frees_the_request(cluster) -> None:
    body = {"model": MODEL, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "a long story please"}]}
    with httpx.stream("POST", f"http://{cluster.http_address}/v1/chat/completions", json=body,
                      timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event: the connection closes
    time.sleep(0.5)
    wait_for_baseline(cluster.decode_address)


def test_bench_multiturn_over_openai_text_chat_reuses_like_token_ids(cluster) -> None:
    config = MultiturnConfig(clients=2, rounds=3, request_length=30, sub_question_length=6,
                             output_length=10, api="openai", timeout_s=120,
                             connect_timeout_s=30)
    report = run(run_multiturn(cluster.http_address, config))
    assert not report["errors"] and not report["defects"]
    assert report["totals"][INCREMENTAL]["reuse_ratio_rounds_ge1"] == 1.0
    for entry in report["rounds"][1:]:
        s = entry[INCREMENTAL]
        assert s["cached_tokens"] == s["reusable_tokens"] > 0


def test_sigterm_mid_stream_ends_the_stream_with_an_error_within_the_grace(tmp_path_factory):
    """SIGTERM to decode while an HTTP stream decodes: the stream ends with an error event
    (not a cut connection) within the drain grace, and decode exits 0 (a new user's trial
    found it cut after ~24 s and decode SIGKILLed)."""
    # tiny-random decodes about a thousand tokens a second here: a 4,000-token stream outlasts
    # a 0.3 s grace several times over.
    grace_s = 0.3
    c = make_cluster(tmp_path_factory, "openai-drain", http_port=0, num_pages=512,
                     decode_args=["--drain-timeout-s", str(grace_s)])
    try:
        body = {"model": MODEL, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True, "messages": [{"role": "user", "content": "a long story"}]}
        events = []
        with httpx.stream("POST", f"http://{c.http_address}/v1/chat/completions", json=body,
                          timeout=60) as reply:
            lines = reply.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break
            signalled = time.monotonic()
            c.proc("decode").send_signal(15)
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        ended = time.monotonic() - signalled
        assert ended < grace_s + 5.0, f"the stream ran {ended:.1f} s past SIGTERM"
        errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
        assert errors, f"the stream finished instead of draining: {events[-3:]}"
        assert "shutting down" in errors[0]["message"] and events[-1] == "[DONE]", errors
        assert c.proc("decode").popen.wait(timeout=grace_s + 10) == 0
    finally:
        c.stop()


def test_fresh_user_errors_and_vllm_top_k(client, cluster) -> None:
    """A fresh user's trial: unknown paths/methods answer OpenAI's error shape, length errors
    name the API field, and vLLM's top_k=-1 ("off") is accepted."""
    base = f"http://{cluster.http_address}"
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/chat/completions", 405)):
        reply = httpx.request(method, base + path)
        assert reply.status_code == status
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as err:  # past the decode service's limit
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert err.value.body["param"] == "max_tokens"
    assert "max_tokens=1000000 exceeds" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # past the model's positions
        client.chat.completions.create(model=MODEL, max_completion_tokens=4,
                                       messages=[{"role": "user", "content": "x" * 9000}])
    assert "context" in err.value.body["message"]
    assert "max_completion_tokens" in err.value.body["message"]
    assert "max_new_tokens" not in err.value.body["message"]
    greedy = dict(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
    off = client.completions.create(**greedy, extra_body={"top_k": -1})
    assert off.choices[0].text == client.completions.create(**greedy).choices[0].text
