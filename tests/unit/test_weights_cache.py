"""The converted-weights cache: a hit loads the same model, and an entry that is truncated,
corrupted, of another weights file or of a changed source is never used but rebuilt; a
location that cannot be written loads without the cache, saying so in one line."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

from deltakv.services.model import loader
from deltakv.services.model.runner import ModelRunner
from deltakv.services.model.source import resolve
from deltakv.services.model.weights_cache import (
    ENV_VAR,
    WeightsCache,
    default_cache_dir,
    source_digest,
)

PROMPT = [1, 80, 90, 100, 3, 7, 250, 2, 1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


class Events:
    """A structlog stand-in that records (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields) -> None:
        self.lines.append(("warning", event, fields))

    def events(self) -> list[str]:
        return [event for _, event, _ in self.lines if event != "startup_phase"]


def last_logits(model):
    return ModelRunner(model, model.new_pool(16, 4)).prefill(PROMPT, [0, 1], 0)


@pytest.fixture
def hf_dir(tmp_path):
    """tiny-random saved as a Hugging Face directory (config.json + safetensors + tokenizer)."""
    hf_model, tokenizer = loader.load_transformers_model("tiny-random")
    path = tmp_path / "tiny-hf"
    hf_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def entry_path(hf_dir, cache_dir):
    digest = source_digest(loader._digest_files(resolve(str(hf_dir))))
    return WeightsCache(cache_dir).path(digest, torch.float32)


def load(hf_dir, cache_dir):
    events = Events()
    model = loader.load_model(str(hf_dir), cache_dir=cache_dir, log=events)
    return model, events


def test_a_hit_loads_the_same_model_from_the_mapped_file(hf_dir, tmp_path):
    cache_dir = tmp_path / "cache"
    reference = loader.load_model(str(hf_dir))
    first, events = load(hf_dir, cache_dir)
    assert events.events() == ["weights_cache_miss", "weights_cache_written"]
    second, events = load(hf_dir, cache_dir)
    assert events.events() == []  # a hit says nothing
    for model in (first, second):
        torch.testing.assert_close(last_logits(model), last_logits(reference), atol=0, rtol=0)
        assert model.geometry == reference.geometry
        assert model.eos_token_ids == reference.eos_token_ids
        assert model.tokenizer("héllo")["input_ids"] == reference.tokenizer("héllo")["input_ids"]
    phases = [f["phase"] for _, e, f in events.lines if e == "startup_phase"]
    assert phases == ["weights", "pack"]
    assert sorted(p.name.split("-", 1)[1] for p in cache_dir.iterdir()
                  if p.suffix != ".lock") == ["config.json", "float32.safetensors", "tokenizer"]


def _rebuilt(hf_dir, cache_dir, reason: str):
    reference = loader.load_model(str(hf_dir))
    model, events = load(hf_dir, cache_dir)
    invalid = [f for _, e, f in events.lines if e == "weights_cache_invalid"]
    assert len(invalid) == 1 and reason in invalid[0]["reason"], events.lines
    assert events.events()[-1] == "weights_cache_written"
    torch.testing.assert_close(last_logits(model), last_logits(reference), atol=0, rtol=0)
    _, events = load(hf_dir, cache_dir)  # the rebuilt entry is used
    assert events.events() == []


def test_a_truncated_entry_is_rebuilt(hf_dir, tmp_path):
    cache_dir = tmp_path / "cache"
    load(hf_dir, cache_dir)
    path = entry_path(hf_dir, cache_dir)
    os.truncate(path, path.stat().st_size - 100)
    _rebuilt(hf_dir, cache_dir, "truncated")


def test_a_corrupted_entry_is_rebuilt(hf_dir, tmp_path):
    cache_dir = tmp_path / "cache"
    load(hf_dir, cache_dir)
    path = entry_path(hf_dir, cache_dir)
    with path.open("r+b") as handle:  # flip bytes in the middle of the tensor data
        handle.seek(path.stat().st_size // 2)
        handle.write(b"\xff\x00\xff\x00")
    _rebuilt(hf_dir, cache_dir, "checksum")


def test_an_entry_of_another_weights_file_is_rebuilt(hf_dir, tmp_path):
    """An entry copied over this source's name (another model's converted weights) is
    refused by the source digest it records."""
    other = tmp_path / "other-hf"
    shutil.copytree(hf_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6  # another source, same shapes
    (other / "config.json").write_text(json.dumps(config))
    cache_dir = tmp_path / "cache"
    load(other, cache_dir)
    entry_path(other, cache_dir).rename(entry_path(hf_dir, cache_dir))
    _rebuilt(hf_dir, cache_dir, "source_sha256")


def test_a_changed_source_misses_its_stale_entry(hf_dir, tmp_path):
    cache_dir = tmp_path / "cache"
    before, _ = load(hf_dir, cache_dir)
    weights = next(hf_dir.glob("*.safetensors"))
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    after, events = load(hf_dir, cache_dir)
    assert events.events() == ["weights_cache_miss", "weights_cache_written"]
    assert torch.equal(after.module.final_norm, before.module.final_norm * 2)
    assert len(list(cache_dir.glob("*.safetensors"))) == 2


def test_an_unwritable_location_loads_without_the_cache_in_one_line(hf_dir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for attempt in range(2):
        model, events = load(hf_dir, blocker / "cache")
        warnings = [(e, f) for level, e, f in events.lines if level == "warning"]
        assert len(warnings) == 1, events.lines
        event, fields = warnings[0]
        assert event == "weights_cache_unwritable"
        assert fields["detail"] == "loading without the weights cache"
        assert str(blocker / "cache") in fields["path"]
        torch.testing.assert_close(last_logits(model),
                                   last_logits(loader.load_model(str(hf_dir))), atol=0, rtol=0)
        # ... and one human line on stderr, once per process.
        err = capsys.readouterr().err.splitlines()
        told = [line for line in err if "weights cache" in line]
        assert len(told) == (1 if attempt == 0 else 0), err
        if told:
            assert told[0].startswith(f"deltakv: the weights cache {blocker / 'cache'} cannot "
                                      f"be written (Not a directory): loading without it")


def test_up_says_in_one_line_when_the_cache_cannot_be_written(tmp_path):
    from deltakv.services.cli.up import cache_warning

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    line = cache_warning("smollm2", str(blocker / "cache"))
    assert line.startswith(f"the weights cache {blocker / 'cache'} cannot be written")
    assert "\n" not in line
    assert cache_warning("smollm2", str(tmp_path / "fine")) is None
    assert not list((tmp_path / "fine").iterdir())  # the probe removed what it made
    assert cache_warning("tiny-random", str(blocker / "cache")) is None
    assert cache_warning("smollm2", "off") is None


def test_a_header_longer_than_the_file_is_invalid(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    cache = WeightsCache(tmp_path)
    path.rename(cache.path("ab" * 32, torch.float32))
    events = Events()
    assert WeightsCache(tmp_path, events).load("ab" * 32, torch.float32) is None
    assert events.events() == ["weights_cache_invalid"]


def test_the_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.setenv(ENV_VAR, "off")
    assert default_cache_dir() is None
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "deltakv"


def test_the_sidecars_geometry_from_the_cached_config_matches_the_workers(hf_dir, tmp_path,
                                                                          monkeypatch):
    """A sidecar sizes its pool from the cached config (no transformers import); the
    fingerprint must be exactly the one the worker computes from the loaded model."""
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    model, _ = load(hf_dir, tmp_path / "cache")
    for _ in range(2):  # written on the first call, read back on the second
        loader._config_cached.cache_clear()
        assert loader.kv_geometry(str(hf_dir)) == model.geometry
    assert list((tmp_path / "cache").glob("*-config.json"))
