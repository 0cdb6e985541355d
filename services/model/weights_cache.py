"""A disk cache of converted weights: what a model's source file becomes in the compute dtype.

Converting a checkpoint (de-quantizing a GGUF file, casting to the compute dtype) costs seconds
at every start and leaves the loading path's buffers behind; the converted tensors depend on
nothing but the source bytes and the dtype. So the first start writes them, with the model's
config, to one safetensors file, and later starts memory-map that file.

Where: ``--cache-dir``, else ``$DELTAKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/deltakv``, else
``~/.cache/deltakv`` (:func:`default_cache_dir`; ``off`` for either: no cache). The config
and the tokenizer (which a GGUF file takes ~15 s each to parse on a 2-core machine) are kept
beside the weights, so a sidecar sizing its pool reads the config from there too. An entry is named by the SHA-256 of the
source files (every byte) and the dtype. It is used only when all of these hold, else it is
rebuilt (and the reason logged):

* the file is exactly as long as its safetensors header says (a truncated write shows);
* its metadata names this format version, this source digest and this dtype (an entry copied
  from another weights file, or left by an older deltakv, shows);
* the xxh3-64 of its tensors equals the one recorded when it was written (~20 GB/s: a
  corrupted page shows, and reading it faults the mapping in before the weights are packed).

Writes go to a temporary file in the same directory, then ``os.replace`` (atomic: a reader sees
the old entry or the whole new one; two workers filling the cache at once both succeed). A
location that cannot be written (read-only, no space) is not an error: one warning line, and
the model loads without the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltakv.errors import InvalidArgument

if TYPE_CHECKING:  # imported where used: `deltakv up` reads ENV_VAR without loading torch
    import torch

ENV_VAR = "DELTAKV_CACHE_DIR"
# Bump when what an entry holds or how it is derived changes: older entries then miss.
FORMAT = "deltakv-weights-2"
_HASH_CHUNK = 16 << 20
# How long a process waits for another one filling the same entry before it converts the
# weights itself (a conversion takes well under this; the lock dies with its holder).
FILL_WAIT_S = 600.0
_FILL_POLL_S = 0.2


# Directories whose "cannot be written" line this process has printed on stderr already.
_TOLD_UNWRITABLE: set[str] = set()


class CacheInvalid(Exception):
    """An entry that must not be used (the message says why)."""


def default_cache_dir() -> Path | None:
    """``$DELTAKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/deltakv``, else ``~/.cache/deltakv``;
    None when ``$DELTAKV_CACHE_DIR`` is ``off``."""
    explicit = os.environ.get(ENV_VAR)
    if explicit == "off":
        return None
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "deltakv"


def unwritable_reason(directory: str | os.PathLike[str]) -> str | None:
    """Why no entry could be written under ``directory`` (``"Permission denied"``, ``"Not a
    directory"``, ...), or None when a file can be created there (made and removed again;
    the directory is created if missing)."""
    try:
        path = Path(directory).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".deltakv-write-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def unwritable_line(directory: str | os.PathLike[str], reason: str) -> str:
    """The one human line for a cache location that cannot be written."""
    return (f"the weights cache {directory} cannot be written ({reason}): loading without "
            f"it, so every start converts the weights again (--cache-dir DIR or "
            f"${ENV_VAR} choose another place)")


def source_digest(files: list[Path]) -> str:
    """SHA-256 (hex) over the names, sizes and every byte of ``files``, in order."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    """xxh3-64 (hex) over every tensor's name and bytes, in name order (reads every byte: on a
    memory-mapped entry this also faults the mapping in)."""
    import torch
    import xxhash

    hasher = xxhash.xxh3_64()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        hasher.update(f"{name}\0{tuple(tensor.shape)}\0".encode())
        if tensor.numel():
            hasher.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``path`` and where its data starts; CacheInvalid if the file
    is not as long as the header says."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CacheInvalid(f"truncated ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CacheInvalid(f"truncated header ({size} bytes, header says {header_len})")
        try:
            header = json.loads(handle.read(header_len))
        except ValueError:
            raise CacheInvalid("unreadable header") from None
    data_start = 8 + header_len
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected = data_start + max(ends, default=0)
    if size != expected:
        raise CacheInvalid(f"{size} bytes where its header says {expected} (truncated or "
                           f"appended to)")
    return header, data_start


class WeightsCache:
    """Converted weights under ``directory``; ``log``: a structlog logger for the one line a
    miss, an invalid entry or an unwritable location gets (None: silent)."""

    def __init__(self, directory: str | os.PathLike[str], log: Any = None) -> None:
        self.directory = Path(directory).expanduser()
        self.log = log
        self._unwritable_said = False  # one line per load, however many writes fail

    def path(self, digest: str, dtype: torch.dtype) -> Path:
        """Where the entry of source ``digest`` in ``dtype`` lives."""
        return self.directory / f"{digest[:32]}-{str(dtype).removeprefix('torch.')}.safetensors"

    @contextlib.contextmanager
    def filling(self, name: str, wait_s: float = FILL_WAIT_S) -> Iterator[None]:
        """Hold the fill lock ``name`` (an advisory ``flock`` on a file in the cache) while
        the block runs, so that of the processes starting together (prefill and decode, both
        sidecars) one converts and the others then hit its entry instead of converting too.
        Waits at most ``wait_s``, then runs the block without the lock; a location where no
        lock file can be made runs it without one (its store will say why)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield
            return
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(_FILL_POLL_S)
            yield
        finally:
            os.close(fd)  # releases the lock

    def load(self, digest: str, dtype: torch.dtype, *, again: bool = False
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """``(tensors, config)`` of a valid entry, tensors memory-mapped from the file (read
        only: never write into them); None on a miss or an invalid entry (logged; ``again``:
        a second look after :meth:`filling`: its miss was logged already)."""
        path = self.path(digest, dtype)
        if not path.is_file():
            if not again:
                self._note("weights_cache_miss", path=str(path))
            return None
        try:
            return self._load_checked(path, digest, dtype)
        except (CacheInvalid, OSError, ValueError, KeyError) as exc:
            if not again:
                self._note("weights_cache_invalid", path=str(path), reason=str(exc))
            return None

    def _load_checked(self, path: Path, digest: str, dtype: torch.dtype
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        from safetensors.torch import load_file

        header, _ = _read_header(path)
        meta = header.get("__metadata__") or {}
        wanted = {"format": FORMAT, "source_sha256": digest, "dtype": str(dtype)}
        for key, value in wanted.items():
            if meta.get(key) != value:
                raise CacheInvalid(f"{key} is {meta.get(key)!r}, not {value!r}")
        tensors = load_file(str(path))
        if tensors_hash(tensors) != meta.get("tensors_xxh3_64"):
            raise CacheInvalid("tensor bytes differ from the checksum written with them")
        return tensors, json.loads(meta["config"])

    def store(self, digest: str, dtype: torch.dtype, tensors: dict[str, torch.Tensor],
              config: dict[str, Any]) -> Path | None:
        """Write an entry atomically; its path, or None when the location cannot be written
        (one warning line: the caller loads without the cache)."""
        from safetensors.torch import save_file

        path = self.path(digest, dtype)
        contiguous = {name: t.contiguous() for name, t in tensors.items()}
        meta = {"format": FORMAT, "source_sha256": digest, "dtype": str(dtype),
                "config": json.dumps(config, sort_keys=True, default=str),
                "tensors_xxh3_64": tensors_hash(contiguous)}
        if not self._atomic(path, lambda tmp: save_file(contiguous, tmp, metadata=meta)):
            return None
        self._note("weights_cache_written", path=str(path))
        return path

    # -- config and tokenizer: the parts of a GGUF file that take longest to parse ------------

    def config_path(self, digest: str) -> Path:
        """Where the config of source ``digest`` lives (JSON)."""
        return self.directory / f"{digest[:32]}-config.json"

    def load_config(self, digest: str) -> dict[str, Any] | None:
        """The cached config dict of source ``digest``, or None (missing or not this
        source's: a copied or stale file is ignored)."""
        try:
            record = json.loads(self.config_path(digest).read_text())
        except (OSError, ValueError):
            return None
        if (not isinstance(record, dict) or record.get("format") != FORMAT
                or record.get("source_sha256") != digest
                or not isinstance(record.get("config"), dict)):
            self._note("weights_cache_invalid", path=str(self.config_path(digest)),
                       reason="config of another source or format")
            return None
        return record["config"]

    def store_config(self, digest: str, config: dict[str, Any]) -> None:
        """Write the config of source ``digest`` atomically (an unwritable location: one
        warning line, nothing else)."""
        record = {"format": FORMAT, "source_sha256": digest, "config": config}
        text = json.dumps(record, sort_keys=True, default=str)
        self._atomic(self.config_path(digest), lambda tmp: Path(tmp).write_text(text))

    def tokenizer_dir(self, digest: str) -> Path | None:
        """The saved tokenizer of source ``digest`` (``save_pretrained`` output), or None."""
        path = self.directory / f"{digest[:32]}-tokenizer"
        try:
            marker = json.loads((path / "deltakv-source.json").read_text())
        except (OSError, ValueError):
            return None
        if marker != {"format": FORMAT, "source_sha256": digest}:
            return None
        return path

    def store_tokenizer(self, digest: str, tokenizer: Any) -> None:
        """Save ``tokenizer`` for source ``digest``: into a temporary directory, renamed into
        place whole (a concurrent writer's complete copy wins; an unwritable location: one
        warning line)."""
        import shutil

        path = self.directory / f"{digest[:32]}-tokenizer"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=self.directory))
        except OSError as exc:
            self._unwritable(exc)
            return
        try:
            tokenizer.save_pretrained(str(tmp))
            (tmp / "deltakv-source.json").write_text(
                json.dumps({"format": FORMAT, "source_sha256": digest}))
            shutil.rmtree(path, ignore_errors=True)  # a stale copy (its marker did not match)
            os.rename(tmp, path)
        except OSError as exc:
            if self.tokenizer_dir(digest) is None:  # not merely a concurrent writer first
                self._unwritable(exc)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _atomic(self, path: Path, write: Any) -> bool:
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=self.directory)
            os.close(fd)
            write(tmp)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            tmp = None
            return True
        except OSError as exc:
            self._unwritable(exc)
            return False
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _unwritable(self, exc: OSError) -> None:
        if self._unwritable_said:
            return
        self._unwritable_said = True
        reason = exc.strerror or str(exc)
        if str(self.directory) not in _TOLD_UNWRITABLE:
            # The log line goes to JSON logs; a person running the command reads stderr.
            _TOLD_UNWRITABLE.add(str(self.directory))
            print(f"deltakv: {unwritable_line(self.directory, reason)}", file=sys.stderr,
                  flush=True)
        self._note("weights_cache_unwritable", level="warning", path=str(self.directory),
                   reason=reason, detail="loading without the weights cache")

    def _note(self, event: str, level: str = "info", **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **fields)


def checkpoint_view(config: Any, tensors: dict[str, torch.Tensor], model: str) -> Any:
    """The attribute tree :meth:`PagedLlama.from_transformers` reads (``model.layers[i]
    .self_attn.q_proj.weight``, ...) over a Llama-layout state dict, without building
    transformers' model (importing its modeling code costs seconds of every start).
    InvalidArgument if a tensor the config calls for is missing."""
    def take(name: str, optional: bool = False) -> torch.Tensor | None:
        if name in tensors:
            return tensors[name]
        if optional:
            return None
        raise InvalidArgument(f"weights cache entry of {model!r} does not fit its config "
                              f"(no {name})")

    def linear(prefix: str) -> types.SimpleNamespace:
        weight = take(f"{prefix}.weight")
        return types.SimpleNamespace(weight=weight, bias=take(f"{prefix}.bias", optional=True),
                                     out_features=weight.shape[0])

    def norm(prefix: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(weight=take(f"{prefix}.weight"))

    layers = []
    for i in range(int(config.num_hidden_layers)):
        p = f"model.layers.{i}"
        layers.append(types.SimpleNamespace(
            input_layernorm=norm(f"{p}.input_layernorm"),
            post_attention_layernorm=norm(f"{p}.post_attention_layernorm"),
            self_attn=types.SimpleNamespace(**{n: linear(f"{p}.self_attn.{n}") for n in (
                "q_proj", "k_proj", "v_proj", "o_proj")}),
            mlp=types.SimpleNamespace(**{n: linear(f"{p}.mlp.{n}") for n in (
                "gate_proj", "up_proj", "down_proj")})))
    embed = norm("model.embed_tokens")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = embed if tied else norm("lm_head")
    return types.SimpleNamespace(
        config=config, lm_head=head,
        model=types.SimpleNamespace(embed_tokens=embed, layers=layers,
                                    norm=norm("model.norm")))
