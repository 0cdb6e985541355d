"""``deltakv generate --local`` as a real process: the aggregated reference generation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltakv.services.model.loader import load_model
from deltakv.services.model.tokenizer import encode_chat
from tests.e2e.reference import reference_tokens

REPO = Path(__file__).resolve().parents[2]


def deltakv(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the ``deltakv`` command in a child process; killed if it outlives ``timeout``."""
    return subprocess.run([sys.executable, "-m", "deltakv.services.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_answers_the_capital_of_france(tmp_path):
    # The first run converts the GGUF weights into the cache, the second maps them from it:
    # the same answer either way.
    cache = tmp_path / "weights-cache"
    args = ("generate", "--local", "--model", "smollm2", "--prompt",
            "What is the capital of France?", "--max-new-tokens", "32", "--json",
            "--cache-dir", str(cache))
    result = deltakv(*args)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] == 2
    assert 1 <= len(out["token_ids"]) <= 32
    assert any(p.suffix == ".safetensors" for p in cache.rglob("*")), list(cache.rglob("*"))
    again = deltakv(*args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == out


@pytest.mark.timeout(300)
def test_tiny_random_json_matches_an_in_process_greedy_run():
    result = deltakv("generate", "--local", "--model", "tiny-random", "--prompt", "hello",
                     "--max-new-tokens", "12", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    model = load_model("tiny-random")
    assert out["prompt_token_ids"] == encode_chat(model.tokenizer,
                                                  [{"role": "user", "content": "hello"}])
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    assert out["text"] == model.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert out["token_ids"] == reference_tokens(out["prompt_token_ids"], 12)


@pytest.mark.timeout(300)
def test_raw_mode_text_output_and_seeded_sampling():
    args = ("generate", "--local", "--model", "tiny-random", "--prompt", "abc", "--raw",
            "--max-new-tokens", "6", "--ignore-eos", "--temperature", "0.8", "--seed", "5",
            "--json")
    first, second = deltakv(*args), deltakv(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["prompt_token_ids"] == [3 + b for b in b"abc"]
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]
    plain = deltakv(*args[:-1])
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.rstrip("\n") == json.loads(first.stdout)["text"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra, message", [
    (("--prompt", ""), "empty prompt"),
    (("--prompt", "hi", "--max-new-tokens", "0"), "max-new-tokens"),
    (("--prompt", "hi", "--model", "no-such-model"), "unknown model"),
    (("--prompt", "hi", "--temperature", "-1"), "temperature"),
])
def test_bad_input_exits_2_with_a_message(extra, message):
    base = ("generate", "--local", "--model", "tiny-random")
    result = deltakv(*base, *extra)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


@pytest.mark.timeout(120)
def test_without_local_it_says_what_to_choose():
    result = deltakv("generate", "--prompt", "hi")
    assert result.returncode == 2 and "--local" in result.stderr
