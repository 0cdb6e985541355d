"""Model loading: configs, weights and tokenizers through ``transformers`` (DESIGN §8).

A model is named as :mod:`deltakv.services.model.source` says (``smollm2``, ``tiny-random``,
a Hugging Face model directory, a ``.gguf`` file).

Nothing is ever downloaded: every ``from_pretrained`` gets ``local_files_only``, and the
``deltakv`` command sets ``HF_HUB_OFFLINE=1`` before any subcommand runs (the entry point's
business, not this module's: importing it changes no environment).
The KV geometry and a fingerprint of the weights are derived from the config and file metadata
alone (:func:`kv_geometry`), so a sidecar can size its pool from a model name without loading it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltakv.errors import InvalidArgument
from deltakv.layout import KVLayout
from deltakv.services.model.source import Source, parse_config, resolve

TINY_RANDOM_SEED = 1234
# Bump when the tiny-random weight generator changes, so old fingerprints stop matching.
_TINY_RANDOM_VERSION = 1
# How much of each weight file the fingerprint reads (head and tail), in bytes.
_FINGERPRINT_SAMPLE_BYTES = 1 << 20
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KVGeometry:
    """Per-token KV shape of a model: ``num_layers`` x (K, V) x ``num_kv_heads`` x ``head_dim``
    elements, and ``fingerprint``, a short id of the weights (equal fingerprints: same model)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    fingerprint: str


def tiny_random_config(**overrides: Any) -> Any:
    """The ``tiny-random`` Llama config: 2 layers, 4 query heads and 2 KV heads of 64, hidden
    256, MLP 512, vocabulary = the byte tokenizer's 259 ids rounded up to 320, untied head.
    ``overrides`` replace fields (tests use them for RoPE scaling, biases, tied heads)."""
    from transformers import LlamaConfig

    from deltakv.services.model.tokenizer import BYTE_TOKENIZER_SIZE

    fields: dict[str, Any] = dict(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    fields.update(overrides)
    if fields["vocab_size"] < BYTE_TOKENIZER_SIZE:
        raise InvalidArgument(f"tiny-random vocab_size must be >= {BYTE_TOKENIZER_SIZE}")
    return LlamaConfig(**fields)


def tiny_random_state_dict(config: Any, seed: int = TINY_RANDOM_SEED) -> dict[str, torch.Tensor]:
    """Seeded random float32 weights for a ``LlamaForCausalLM`` with ``config``.

    Generated in a fixed order from a private ``torch.Generator`` (the global RNG is untouched), so
    a seed always gives the same weights, whatever transformers' own initialisation does.
    Matrices are N(0, 1/sqrt(fan_in)) so activations stay O(1) through the layers; norm weights
    are 1 + N(0, 0.1) so a wrong norm shows up in the logits.
    """
    from transformers import LlamaForCausalLM

    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for name, param in skeleton.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shape = tuple(param.shape)
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * values
        elif name.endswith(".bias"):
            values = 0.1 * values
        elif len(shape) == 2:
            values = values / (shape[-1] ** 0.5)
        state[name] = values
    return state


def tiny_random_transformers(config: Any, dtype: torch.dtype = torch.float32,
                             seed: int = TINY_RANDOM_SEED) -> Any:
    """transformers' ``LlamaForCausalLM`` for ``config`` holding :func:`tiny_random_state_dict`
    weights, in eval mode (the oracle for tiny-random tests). The global RNG is left as it was."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        hf_model = LlamaForCausalLM(config)
    # A tied head has no lm_head entry; it shares the embedding loaded here.
    hf_model.load_state_dict(tiny_random_state_dict(config, seed),
                             strict=not config.tie_word_embeddings)
    return hf_model.to(dtype).eval()


def _canonical_config(config: Any) -> dict[str, Any]:
    # Only what shapes the computation; names and transformers' bookkeeping are left out.
    from deltakv.services.model.llama import LlamaSpec, rope_parameters

    spec = LlamaSpec.from_config(config)
    fields = {k: v for k, v in vars(spec).items()}
    fields["rope"] = {k: v for k, v in sorted(rope_parameters(config).items())}
    return fields


def _file_digest(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(_FINGERPRINT_SAMPLE_BYTES))
        if size > 2 * _FINGERPRINT_SAMPLE_BYTES:
            handle.seek(size - _FINGERPRINT_SAMPLE_BYTES)
            digest.update(handle.read(_FINGERPRINT_SAMPLE_BYTES))
    return {"file": path.name, "bytes": size, "sha256_head_tail": digest.hexdigest()}


def _fingerprint(config: Any, identity: list[Any]) -> str:
    payload = json.dumps({"config": _canonical_config(config), "weights": identity},
                         sort_keys=True, default=str).encode()
    return f"{config.model_type}-{hashlib.sha256(payload).hexdigest()[:16]}"


def _load_config(source: Source, cache: Any = None, digest: str | None = None,
                 transformers_config: bool = False) -> Any:
    """The config of ``source``: transformers' config, or (``transformers_config`` false) a
    namespace of its fields from the weights cache when one is configured (a GGUF file's
    metadata takes seconds to parse), written there on a miss. Processes starting together
    parse it once: the others wait on the cache's fill lock, then read it."""
    if source.kind == "tiny-random":
        return tiny_random_config()
    from deltakv.services.model import weights_cache

    if cache is None and (directory := weights_cache.default_cache_dir()) is not None:
        cache = weights_cache.WeightsCache(directory)
    if cache is None:
        return parse_config(source)
    digest = digest or weights_cache.source_digest(_digest_files(source))
    with cache.filling(f"{digest[:32]}-config"):
        cached = cache.load_config(digest)
        if cached is not None and transformers_config:
            return _transformers_config(cached)
        if cached is not None:
            # The geometry reads plain fields (LlamaSpec.from_config, rope_parameters): a
            # namespace of the saved config gives the same fingerprint without importing
            # transformers (seconds of a sidecar's start).
            return types.SimpleNamespace(**cached)
        config = parse_config(source)
        cache.store_config(digest, config.to_dict())
    return config


def _transformers_config(fields: dict[str, Any]) -> Any:
    """transformers' config object of a saved ``config.to_dict()``."""
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _digest_files(source: Source) -> list[Path]:
    """The files whose bytes name a source in the weights cache."""
    files = source.weight_files()
    if source.kind == "hf":
        files = [*files, source.directory / "config.json"]
    return files


def _stamp(source: Source) -> tuple[Any, ...]:
    """Sizes and mtimes of a checkpoint's files: a replaced checkpoint misses the caches."""
    if source.kind == "tiny-random":
        return ()
    assert source.directory is not None
    paths = [*source.weight_files(), source.directory / "config.json"]
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths if p.exists())


@functools.lru_cache(maxsize=16)
def _weights_identity(source: Source, stamp: tuple[Any, ...]) -> tuple[Any, ...]:
    if source.kind == "tiny-random":
        return ({"tiny_random_seed": TINY_RANDOM_SEED, "generator": _TINY_RANDOM_VERSION},)
    files = source.weight_files()
    if not files:
        raise InvalidArgument(f"model directory {source.directory} has no weight files")
    return tuple(_file_digest(path) for path in files)


@functools.lru_cache(maxsize=16)
def _config_cached(source: Source, stamp: tuple[Any, ...]) -> Any:
    return _load_config(source)


def _geometry(source: Source, config: Any) -> KVGeometry:
    from deltakv.services.model.llama import LlamaSpec

    spec = LlamaSpec.from_config(config)
    identity = list(_weights_identity(source, _stamp(source)))
    return KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                      _fingerprint(config, identity))


def kv_geometry(model: str) -> KVGeometry:
    """KV geometry and weight fingerprint of ``model`` from its config and file metadata only
    (no weights are read beyond a few MiB for the fingerprint; cached per process).

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for an unknown name or unsupported
    architecture, :class:`NotFound` (NOT_FOUND) when the SmolLM2 package is missing.
    """
    source = resolve(model)
    return _geometry(source, _config_cached(source, _stamp(source)))


@dataclass
class LoadedModel:
    """A loaded model: ``module`` (the paged decoder's weights), its ``tokenizer`` and the facts
    the services need. ``eos_token_ids``: ids that end a generation; ``vocab_size``: rows of the
    embedding (token ids must be below it). Read-only after loading; share it across threads."""

    name: str
    config: Any
    module: Any  # deltakv.services.model.llama.PagedLlama
    tokenizer: Any
    geometry: KVGeometry
    eos_token_ids: set[int]
    vocab_size: int

    @property
    def weights(self) -> Any:
        """Alias of :attr:`module` (the :class:`~deltakv.services.model.llama.PagedLlama`)."""
        return self.module

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the weights."""
        return self.module.dtype

    def kv_layout(self, page_size: int, num_pages: int, dtype: str = "float32") -> KVLayout:
        """The sidecar pool layout for this model: ``page_size`` tokens per page, ``num_pages``
        pages, KV stored as ``dtype`` (a :data:`deltakv.layout.DTYPES` key). Raises
        :class:`InvalidArgument` (INVALID_ARGUMENT) on non-positive sizes or unknown dtype."""
        return KVLayout(num_layers=self.geometry.num_layers,
                        num_kv_heads=self.geometry.num_kv_heads,
                        head_dim=self.geometry.head_dim, dtype=dtype, page_size=page_size,
                        num_pages=num_pages, model_fingerprint=self.geometry.fingerprint)

    def new_pool(self, page_size: int, num_pages: int, dtype: str = "float32") -> torch.Tensor:
        """A zeroed private pool tensor ``[num_pages, L, 2, page_size, Hkv, D]`` for single-process
        use (``deltakv generate --local``, tests, benchmarks); the caller owns it."""
        layout = self.kv_layout(page_size, num_pages, dtype)
        return torch.zeros(layout.pool_shape, dtype=layout.torch_dtype)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _COMPUTE_DTYPES:
        raise InvalidArgument(f"unsupported compute dtype {dtype}; use float32, bfloat16 or "
                              f"float16")


def _eos_ids(config: Any, tokenizer: Any, generation_config: Any = None) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(config, "eos_token_id", None),
                  getattr(generation_config, "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple, set)) else [value]))
    return ids


def load_transformers_model(model: str, dtype: torch.dtype = torch.float32, *,
                            config: Any = None) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)``: the model as transformers' own ``*ForCausalLM`` in eval mode, and
    its tokenizer. It is the weight source of :func:`load_model` and the test/benchmark oracle.
    ``config``: the model's transformers config when the caller has it already (else parsed
    here, once: a GGUF file's metadata is read for it, then only for the tensors).

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for an unknown model or unsupported
    dtype, :class:`NotFound` (NOT_FOUND) when the SmolLM2 package is missing.
    """
    _check_dtype(dtype)
    source = resolve(model)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from deltakv.services.model.tokenizer import build_byte_tokenizer

    if source.kind == "tiny-random":
        return tiny_random_transformers(tiny_random_config(), dtype), build_byte_tokenizer()
    kwargs = source.pretrained_kwargs()
    # transformers' tqdm bars would spam logs and the CLI's stdout-based JSON mode.
    hf_logging.disable_progress_bar()
    if config is None:
        config = parse_config(source)
    tokenizer = _load_tokenizer(source, config)
    hf_model = AutoModelForCausalLM.from_pretrained(str(source.directory), config=config,
                                                    dtype=dtype, **kwargs)
    return hf_model.eval(), tokenizer


def _load_tokenizer(source: Source, config: Any) -> Any:
    return _tokenizer_class(source, config).from_pretrained(str(source.directory),
                                                            **source.pretrained_kwargs())


def _load_gguf_direct(source: Source, dtype: torch.dtype, config: Any,
                      log: Any) -> tuple[dict[str, torch.Tensor], Any] | None:
    """``(state dict, tokenizer)`` of a GGUF source read with the ``gguf`` library (see
    :mod:`~deltakv.services.model.gguf_weights`), or None when that is not a GGUF file of a
    supported architecture (then transformers' GGUF loader is the way)."""
    if not source.gguf_file:
        return None
    from deltakv.services.model.gguf_weights import read_state_dict

    state = read_state_dict(source.directory / source.gguf_file, config, dtype, log)
    return None if state is None else (state, _load_tokenizer(source, config))


def _tokenizer_class(source: Source, config: Any) -> Any:
    """AutoTokenizer, except for a GGUF model whose type has no tokenizer class of its own:
    then the generic fast tokenizer AutoTokenizer would pick too, without first reading the
    file's whole metadata again to learn the model type (the tokenizer itself is built from
    the vocabulary arrays alone)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if source.gguf_file and TOKENIZER_MAPPING_NAMES.get(config.model_type) is None:
        from transformers import TokenizersBackend

        return TokenizersBackend
    return AutoTokenizer


def loaded_from_transformers(name: str, hf_model: Any, tokenizer: Any,
                             geometry: KVGeometry | None = None) -> LoadedModel:
    """Wrap an already loaded transformers model (see :func:`load_transformers_model`) as a
    :class:`LoadedModel`, sharing its embedding and norm tensors. ``geometry`` defaults to
    :func:`kv_geometry` of ``name``."""
    from deltakv.services.model.llama import PagedLlama

    module = PagedLlama.from_transformers(hf_model)
    if geometry is None:
        geometry = _geometry(resolve(name), hf_model.config)
    spec = module.spec
    if (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) != (
            spec.num_layers, spec.num_kv_heads, spec.head_dim):
        raise InvalidArgument(f"geometry {geometry} does not match the weights of {name!r}")
    return LoadedModel(
        name=name, config=hf_model.config, module=module, tokenizer=tokenizer, geometry=geometry,
        eos_token_ids=_eos_ids(hf_model.config, tokenizer,
                               getattr(hf_model, "generation_config", None)),
        vocab_size=spec.vocab_size,
    )


def load_model(model: str, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", *,
               cache_dir: str | Path | None = None, log: Any = None) -> LoadedModel:
    """Load ``model`` (``"smollm2"``, ``"tiny-random"``, an HF directory or a ``.gguf`` path) for
    the paged runner, computing in ``dtype`` (float32 default; GGUF weights are dequantized:
    a llama file read directly with the ``gguf`` library, others through transformers) on
    ``device`` (the weights are moved there before the runner takes them).

    ``cache_dir``: a :class:`~deltakv.services.model.weights_cache.WeightsCache` location for
    the converted weights (None: no cache; ``tiny-random`` is never cached). ``log``: a
    structlog logger for the start-up phases (``weights``, ``pack``) and the cache's lines.
    Nothing of the loading path stays referenced: the weights' state dict (or transformers'
    model object) is dropped once its weights are packed.

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for an unknown model, unsupported
    architecture or dtype; :class:`NotFound` (NOT_FOUND) when the SmolLM2 package is missing.
    """
    import time

    from deltakv.services.runtime.startup import log_phase, phase

    start = time.perf_counter()
    if cache_dir is None or resolve(model).kind == "tiny-random":
        hf_model, tokenizer = _load_uncached(model, dtype, log, device)
        cache = "off"
    else:
        hf_model, tokenizer, hit = _load_through_cache(model, dtype, cache_dir, log, device)
        cache = "hit" if hit else "miss"
    if isinstance(hf_model, torch.nn.Module):  # a cache hit's view is already on ``device``
        hf_model = hf_model.to(device)
    log_phase(log, "weights", time.perf_counter() - start, cache=cache)
    with phase(log, "pack"):
        return loaded_from_transformers(model, hf_model, tokenizer)


def _load_uncached(model: str, dtype: torch.dtype, log: Any,
                   device: str | torch.device) -> tuple[Any, Any]:
    source = resolve(model)
    if source.gguf_file:
        _check_dtype(dtype)
        config = parse_config(source)
        direct = _load_gguf_direct(source, dtype, config, log)
        if direct is not None:
            from deltakv.services.model.weights_cache import checkpoint_view

            state = {k: v.to(device) for k, v in direct[0].items()}
            return checkpoint_view(config, state, model), direct[1]
        return load_transformers_model(model, dtype, config=config)
    return load_transformers_model(model, dtype)


def _load_through_cache(model: str, dtype: torch.dtype, cache_dir: str | Path,
                        log: Any, device: str | torch.device = "cpu") -> tuple[Any, Any, bool]:
    """``(hf_model, tokenizer, hit)``: on a hit the weights memory-mapped from the cache
    entry of the source files' digest, as the attribute tree of a transformers model (no
    model object is built) with the config as a namespace; on a miss transformers' own model,
    converted and written there first."""
    from deltakv.services.model.weights_cache import (
        WeightsCache,
        checkpoint_view,
        source_digest,
    )

    _check_dtype(dtype)
    source = resolve(model)
    cache = WeightsCache(cache_dir, log)
    digest = source_digest(_digest_files(source))
    entry = cache.load(digest, dtype)
    if entry is None:
        with cache.filling(cache.path(digest, dtype).stem):
            entry = cache.load(digest, dtype, again=True)  # filled by a process beside?
            if entry is None:
                # The config through the cache's config entry (a sidecar may have parsed it
                # already, or waits for this one), so the GGUF metadata is parsed once.
                config = _load_config(source, cache, digest, transformers_config=True)
                direct = _load_gguf_direct(source, dtype, config, log)
                if direct is not None:
                    state, tokenizer = direct
                    if cache.store(digest, dtype, state, config.to_dict()) is not None:
                        cache.store_config(digest, config.to_dict())
                        cache.store_tokenizer(digest, tokenizer)
                    state = {k: v.to(device) for k, v in state.items()}
                    return checkpoint_view(config, state, model), tokenizer, False
                hf_model, tokenizer = load_transformers_model(model, dtype, config=config)
                tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
                state = {k: v for k, v in hf_model.state_dict().items()
                         if not (tied and k == "lm_head.weight")}  # one tensor, stored once
                if cache.store(digest, dtype, state, hf_model.config.to_dict()) is not None:
                    cache.store_config(digest, hf_model.config.to_dict())
                    cache.store_tokenizer(digest, tokenizer)
                return hf_model, tokenizer, False
    tensors, config_dict = entry
    # PagedLlama copies every projection (fused and packed) but shares the embedding and the
    # norms: copy those out of the mapping, so that the file is unmapped once loading ends
    # (on another device the move is that copy).
    tensors = {k: (v if "_proj." in k or torch.device(device).type != "cpu" else v.clone())
               .to(device) for k, v in tensors.items()}
    config = types.SimpleNamespace(**config_dict)
    from deltakv.services.model.llama import LlamaSpec

    if LlamaSpec.from_config(config).rope_type != "default":
        # Scaled RoPE variants are computed by transformers' initialisers from its config.
        config = _transformers_config(config_dict)
    hf_model = checkpoint_view(config, tensors, model)
    from transformers import AutoTokenizer

    saved = cache.tokenizer_dir(digest)
    if saved is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(source.directory),
                                                  **source.pretrained_kwargs())
        cache.store_tokenizer(digest, tokenizer)
    return hf_model, tokenizer, True

