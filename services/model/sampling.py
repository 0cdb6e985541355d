"""Token sampling (greedy, temperature, top-k, top-p, per-request seed) and stop rules.

A :class:`Sampler` belongs to one request: its random generator is private, so a seeded request
draws the same tokens whatever else the worker runs concurrently.

Ranges (:func:`validate_sampling`, one set of rules for the public edge, prefill and the
sampler itself; INVALID_ARGUMENT otherwise, before anything is allocated): ``temperature`` 0
(greedy) or finite and >= :data:`MIN_TEMPERATURE`; ``top_p`` in (0, 1] (0 on the wire means
1); ``top_k`` >= 0; ``seed`` in [0, 2**64). :data:`MIN_TEMPERATURE` is vLLM's: its
``SamplingParams`` raises smaller temperatures to 1e-2 because they "may cause numerical errors
nan or inf in tensors" (issue 12: ``temperature=1e-38`` overflowed float32 logits to inf and the
multinomial draw failed). The draw also scales ``logits - max(logits)``, so no finite
temperature can turn the distribution into NaN.
"""

from __future__ import annotations

import math
import secrets
import struct
from collections.abc import Collection

import torch

from deltakv.errors import InvalidArgument
from deltakv.v1 import kv_pb2

_MAX_SEED = 2**64 - 1
#: Smallest non-zero temperature (vLLM's ``_MAX_TEMP``, see the module docstring).
MIN_TEMPERATURE = 1e-2
# The wire field is a float32: 0.01 arrives as 0.009999999776..., which must still pass.
_MIN_TEMPERATURE_WIRE = struct.unpack("<f", struct.pack("<f", MIN_TEMPERATURE))[0]


def _check(temperature: object, top_k: object, top_p: object, seed: object) -> None:
    """InvalidArgument (INVALID_ARGUMENT) naming the first value outside its range."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) \
            or not (temperature == 0 or temperature >= _MIN_TEMPERATURE_WIRE):
        raise InvalidArgument(f"temperature must be 0 (greedy) or a finite number >= "
                              f"{MIN_TEMPERATURE}, got {temperature!r:.40}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidArgument(f"top_k must be an int >= 0, got {top_k!r:.40}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) \
            or not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p!r:.40}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed <= _MAX_SEED):
        raise InvalidArgument(f"seed must be an int in [0, 2**64), got {seed!r:.40}")


def validate_sampling(params: kv_pb2.SamplingParams) -> None:
    """Check wire sampling parameters against the ranges of the module docstring (``top_p``
    0 means 1). Raises :class:`InvalidArgument` (INVALID_ARGUMENT) naming the field."""
    _check(params.temperature, int(params.top_k), params.top_p if params.top_p != 0 else 1.0,
           params.seed if params.HasField("seed") else None)


class Sampler:
    """Picks the next token from logits.

    ``temperature`` 0 means greedy (argmax; ties go to the lowest id), otherwise logits are
    divided by it. ``top_k`` > 0 keeps the k most likely tokens; ``top_p`` < 1 keeps the smallest
    set whose probability reaches ``top_p`` (nucleus). ``seed`` makes the draws reproducible;
    ``None`` seeds from the OS. Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for a value
    outside the ranges of the module docstring.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None) -> None:
        _check(temperature, top_k, top_p, seed)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = float(top_p)
        self.seed = seed
        self._generator: torch.Generator | None = None
        if self.temperature > 0:
            self._generator = torch.Generator()
            # torch seeds are signed 64-bit; fold the unsigned proto seed into that range.
            raw = seed if seed is not None else secrets.randbits(64)
            self._generator.manual_seed(raw - 2**64 if raw >= 2**63 else raw)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(cls, params: kv_pb2.SamplingParams) -> Sampler:
        """From the wire: ``top_p`` 0 means 1 (no nucleus filter), an absent ``seed`` means
        nondeterministic. Raises :class:`InvalidArgument` (INVALID_ARGUMENT) as the constructor."""
        return cls(temperature=params.temperature, top_k=int(params.top_k),
                   top_p=params.top_p if params.top_p != 0 else 1.0,
                   seed=params.seed if params.HasField("seed") else None)

    def sample(self, logits: torch.Tensor) -> int:
        """One token id from float logits ``[vocab]``. Raises :class:`InvalidArgument`
        (INVALID_ARGUMENT) for a tensor that is not 1-d or holds NaN."""
        if logits.dim() != 1 or logits.numel() == 0:
            raise InvalidArgument(f"sample needs logits of shape [vocab], got "
                                  f"{tuple(logits.shape)}")
        logits = logits.detach().float()
        if torch.isnan(logits).any():
            raise InvalidArgument("logits contain NaN")
        if self.greedy:
            return int(torch.argmax(logits))
        # Shifted so the best token scales to 0: no temperature can overflow it to inf.
        scaled = (logits - logits.max()) / self.temperature
        if 0 < self.top_k < scaled.numel():
            kth = torch.topk(scaled, self.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the tokens before it already reach top_p; the first always stays.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= self.top_p
            scaled = scaled.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator))


def should_stop(token_id: int, generated: int, max_new_tokens: int, eos_ids: Collection[int],
                ignore_eos: bool) -> str | None:
    """Why generation ends after ``token_id``, the ``generated``-th new token (counting it):
    ``"stop"`` on an EOS id (unless ``ignore_eos``), ``"length"`` once ``generated >=
    max_new_tokens``, else ``None``. EOS wins when both hold."""
    if not ignore_eos and token_id in eos_ids:
        return "stop"
    if generated >= max_new_tokens:
        return "length"
    return None
