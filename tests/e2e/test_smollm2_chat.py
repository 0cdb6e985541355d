"""A real two-turn chat with SmolLM2-135M-Instruct on a local cluster equals the single-process
reference token for token, and turn 2 reuses every full page of turn 1's prompt + answer although
the answer comes back as text (only the delta moves). The README's curl examples run here
verbatim, only the address changed to this cluster's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deltakv.client import DecodeClient
from tests.e2e.conftest import make_cluster, run
from tests.e2e.reference import reference_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PAGE_BYTES_SMOLLM2 = 737_280  # 30 layers * 2 * 16 tokens * 3 heads * 64 dims * 4 B


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "smollm2", model="smollm2", num_pages=256,
                     start_timeout_s=600.0, http_port=0)
    try:
        yield c
    finally:
        c.stop()


def test_two_turn_chat_equals_reference_and_reuses_turn_one(cluster) -> None:
    async def chat(messages):
        async with DecodeClient(cluster.decode_address, timeout_s=300) as client:
            return await client.generate(chat=messages, max_new_tokens=32,
                                         echo_prompt_token_ids=True)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = run(chat(messages))
    assert "Paris" in first.text
    prompt1 = list(first.usage.prompt_token_ids)
    assert first.token_ids == reference_tokens(prompt1, 32, "smollm2", ignore_eos=False)
    assert first.usage.cached_tokens == 0
    assert first.usage.page_bytes == PAGE_BYTES_SMOLLM2

    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "And what is it famous for?"}]
    second = run(chat(messages))
    prompt2 = list(second.usage.prompt_token_ids)
    assert second.token_ids == reference_tokens(prompt2, 32, "smollm2", ignore_eos=False)
    u = second.usage
    # The answer came back as text; decode spliced the ids it generated, so turn 2's prompt
    # starts with turn 1's prompt + answer ids and every full page of them is reused.
    assert prompt2[: len(prompt1) + len(first.token_ids)] == prompt1 + first.token_ids
    assert u.cached_tokens == (len(prompt1) + len(first.token_ids) - 1) // 16 * 16
    delta = -(-u.prompt_tokens // 16) - u.cached_tokens // 16
    assert (u.transferred_pages, u.transferred_bytes) == (delta, delta * PAGE_BYTES_SMOLLM2)


def test_generate_cli_against_cluster_equals_local(cluster) -> None:
    def cli(*where: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "deltakv.services.cli.main", "generate", *where, "--prompt",
             "Name three primary colors.", "--max-new-tokens", "24", "--json"],
            capture_output=True, text=True, timeout=600, check=True)
        return json.loads(out.stdout)

    remote = cli("--target", cluster.decode_address)
    local = cli("--local", "--model", "smollm2")
    assert remote["prompt_token_ids"] == local["prompt_token_ids"]
    assert remote["token_ids"] == local["token_ids"] and remote["text"] == local["text"]
    assert remote["usage"]["prompt_tokens"] == len(local["prompt_token_ids"])


README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_curl_examples_work(cluster) -> None:
    section = README.read_text().split("## OpenAI-compatible API", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands = [line for line in block.splitlines() if line.startswith("curl ")]
    assert len(commands) == 3
    outputs = []
    for command in commands:
        command = command.replace("127.0.0.1:8000", cluster.http_address)
        done = subprocess.run(["bash", "-c", command + " --fail-with-body -sS"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        outputs.append(done.stdout)
    assert json.loads(outputs[0])["data"][0]["id"] == "smollm2"
    answer = json.loads(outputs[1])
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    events = [line[6:] for line in outputs[2].splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] > 0
