"""KV pool geometry (DESIGN §5): page-major layout, page bytes, compatibility check.

The pool is one C-contiguous tensor of shape
``[num_pages, num_layers, 2 (K,V), page_size, num_kv_heads, head_dim]``; page ``p`` is the
contiguous byte range ``[p * page_bytes, (p + 1) * page_bytes)`` of the pool's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from deltakv.errors import InvalidArgument, LayoutMismatch
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    import torch


class KVDtype(NamedTuple):
    """One element type a pool may hold: bytes per element (IEEE 754 binary32 and binary16;
    bfloat16 is the top half of a binary32) and its ``kv.proto`` enum. The torch dtype of the
    same name is looked up only when a tensor is made (:attr:`KVLayout.torch_dtype`), so
    sizing a pool or parsing a layout never imports torch."""

    itemsize: int
    enum: int


# The only dtypes a pool may hold, by name (the name is also torch's attribute name).
DTYPES: dict[str, KVDtype] = {
    "float32": KVDtype(4, kv_pb2.KV_DTYPE_FLOAT32),
    "bfloat16": KVDtype(2, kv_pb2.KV_DTYPE_BFLOAT16),
    "float16": KVDtype(2, kv_pb2.KV_DTYPE_FLOAT16),
}
_DTYPE_BY_ENUM = {dtype.enum: name for name, dtype in DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :data:`DTYPES` name (imports torch). InvalidArgument if the name
    is not a pool dtype."""
    if name not in DTYPES:
        raise InvalidArgument(f"unsupported KV dtype {name!r}; choose one of {sorted(DTYPES)}")
    import torch

    return getattr(torch, name)

# Fields that must be equal for two pools to exchange pages (everything but num_pages).
PAIRING_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "layout",
                  "model_fingerprint")


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one KV pool.

    Attributes: ``num_layers``, ``num_kv_heads``, ``head_dim`` (elements), ``dtype`` (a key
    of :data:`DTYPES`), ``page_size`` (tokens per page), ``num_pages`` (pages in the pool),
    ``layout`` (always ``"page_major"``), ``model_fingerprint`` (identifies the weights).
    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) on non-positive sizes or unknown dtype.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int = 1024
    layout: str = "page_major"
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"KV layout field {name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"unsupported KV dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.layout != "page_major":
            raise InvalidArgument(f"unsupported pool layout {self.layout!r}; only 'page_major'")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The pool's torch dtype (imports torch on first use)."""
        return torch_dtype(self.dtype)

    @property
    def dtype_size(self) -> int:
        """Bytes per element."""
        return DTYPES[self.dtype].itemsize

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one page: ``[num_layers, 2, page_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        """Shape of the pool tensor: ``[num_pages, *page_shape]``."""
        return (self.num_pages, *self.page_shape)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: num_layers * 2 * page_size * num_kv_heads * head_dim * dtype_size."""
        return (self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim
                * self.dtype_size)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool: num_pages * page_bytes."""
        return self.num_pages * self.page_bytes

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
        return -(-num_tokens // self.page_size)

    def delta_pages(self, prompt_len: int, prefix_len: int) -> int:
        """:func:`delta_pages` with this layout's ``page_size``."""
        return delta_pages(prompt_len, prefix_len, self.page_size)

    def with_pages(self, num_pages: int) -> KVLayout:
        """The same geometry with another pool size."""
        return replace(self, num_pages=num_pages)

    def check_compatible(self, remote: KVLayout) -> None:
        """Raise :class:`LayoutMismatch` (FAILED_PRECONDITION) naming the first differing
        pairing field and both values; ``num_pages`` may differ."""
        for name in PAIRING_FIELDS:
            local_value, remote_value = getattr(self, name), getattr(remote, name)
            if local_value != remote_value:
                raise LayoutMismatch(name, local_value, remote_value)

    def to_proto(self) -> kv_pb2.KVLayout:
        return kv_pb2.KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=DTYPES[self.dtype].enum,
            page_size=self.page_size,
            num_pages=self.num_pages,
            layout=kv_pb2.POOL_LAYOUT_PAGE_MAJOR,
            model_fingerprint=self.model_fingerprint,
        )

    @classmethod
    def from_proto(cls, msg: kv_pb2.KVLayout) -> KVLayout:
        """Parse a protobuf layout; INVALID_ARGUMENT if a field is missing or unknown."""
        if msg.dtype not in _DTYPE_BY_ENUM:
            raise InvalidArgument(f"KV layout has unknown dtype enum {msg.dtype}")
        if msg.layout != kv_pb2.POOL_LAYOUT_PAGE_MAJOR:
            raise InvalidArgument(f"KV layout has unsupported layout enum {msg.layout}")
        return cls(
            num_layers=msg.num_layers,
            num_kv_heads=msg.num_kv_heads,
            head_dim=msg.head_dim,
            dtype=_DTYPE_BY_ENUM[msg.dtype],
            page_size=msg.page_size,
            num_pages=msg.num_pages,
            model_fingerprint=msg.model_fingerprint,
        )


def delta_pages(prompt_len: int, prefix_len: int, page_size: int) -> int:
    """Pages of a ``prompt_len``-token prompt beyond the ``prefix_len`` tokens decode already
    holds: ``ceil(prompt_len / page_size) - prefix_len // page_size`` (DESIGN §1 "delta
    pages"; the last page may be partial). The one delta formula: decode sizes its
    ``TransferInfo`` with it, the planner and prefill check it, clients report it.

    ``prefix_len`` is page-aligned on the wire (the planner rejects anything else); an
    unaligned value here is rounded down, which can only count more pages, never hide one.
    Raises InvalidArgument (INVALID_ARGUMENT) for ``page_size <= 0``, a negative count or
    ``prefix_len > prompt_len``.
    """
    if page_size <= 0:
        raise InvalidArgument(f"page_size must be positive, got {page_size}")
    if prompt_len < 0 or prefix_len < 0:
        raise InvalidArgument(
            f"token counts must be >= 0, got prompt_len={prompt_len} prefix_len={prefix_len}")
    if prefix_len > prompt_len:
        raise InvalidArgument(f"prefix_len={prefix_len} exceeds prompt_len={prompt_len}")
    return -(-prompt_len // page_size) - prefix_len // page_size
