"""A real two-turn chat with SmolLM2-135M-Instruct on a local cluster equals the single-process
reference token for token, and turn 2 reuses turn 1's KV (only the delta moves)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deltakv.client import DecodeClient
from tests.e2e.conftest import make_cluster, run
from tests.e2e.reference import reference_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PAGE_BYTES_SMOLLM2 = 737_280  # 30 layers * 2 * 16 tokens * 3 heads * 64 dims * 4 B


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "smollm2", model="smollm2", num_pages=256,
                     start_timeout_s=600.0)
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
    assert u.cached_tokens > 0 and u.cached_tokens % 16 == 0  # turn 1's pages were reused
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
