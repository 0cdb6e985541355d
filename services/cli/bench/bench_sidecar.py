"""The sidecars and page geometry of the transfer benchmarks (``deltakv bench transfer``,
``deltakv bench completion``): real ``deltakv serve sidecar`` children and the layout they
share."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

DEFAULT_MODEL = "smollm2"
PAGE_SIZE = 16  # tokens per page of the model-derived layout (deltakv up's default)


def bench_layout(page_bytes: int | None, num_pages: int, model: str = DEFAULT_MODEL) -> Any:
    """The benchmark's KVLayout (float32, 16-token pages, ``num_pages`` pages). ``page_bytes``
    None: ``model``'s KV geometry from the model loader (config only, no weights loaded);
    else 1 layer, 1 KV head and ``head_dim = page_bytes / 128``, exactly ``page_bytes`` a
    page. Raises ValueError if ``page_bytes`` is not a positive multiple of 128, the loader's
    InvalidArgument / NotFound for an unknown or missing model."""
    from deltakv.layout import KVLayout

    if page_bytes is None:
        from deltakv.services.model.loader import kv_geometry

        geometry = kv_geometry(model)
        return KVLayout(num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads,
                        head_dim=geometry.head_dim, dtype="float32", page_size=PAGE_SIZE,
                        num_pages=num_pages, model_fingerprint="bench")
    if page_bytes <= 0 or page_bytes % 128:
        raise ValueError(f"--page-bytes must be a positive multiple of 128, got {page_bytes}")
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=page_bytes // 128, dtype="float32",
                    page_size=PAGE_SIZE, num_pages=num_pages, model_fingerprint="bench")


class BenchSidecar:
    """A ``deltakv serve sidecar`` child of a benchmark (a ManagedProcess: dies with the
    benchmark, SIGTERM then SIGKILL on stop), started and waited for at construction
    (Unavailable/ProcessError if it does not serve within ``ready_timeout_s`` seconds).
    ``wrap``: command prefix (e.g. ``ip netns exec NS`` of a two-host link); ``host``: the
    address its engine advertises (default: the sidecar's own default)."""

    def __init__(self, role: str, backend: str, layout: Any, workdir: str,
                 options: list[str], ready_timeout_s: float,
                 extra_args: tuple[str, ...] = (), name: str = "",
                 wrap: Sequence[str] = (), host: str | None = None) -> None:
        from deltakv.rpc.channel import uds_address
        from deltakv.services.process import ManagedProcess

        self.socket = os.path.join(workdir, f"{name or role}-{backend}.sock")
        self.target = uds_address(self.socket)
        cmd = [*wrap, sys.executable, "-m", "deltakv.services.cli.serve.sidecar", "--role", role,
               "--transport", backend, "--socket", self.socket,
               *(["--host", host] if host else []),
               "--pairing-key-file", os.path.join(workdir, "pairing.key"),
               "--page-size", str(layout.page_size), "--num-pages", str(layout.num_pages),
               "--num-layers", str(layout.num_layers), "--num-kv-heads", str(layout.num_kv_heads),
               "--head-dim", str(layout.head_dim), "--dtype", layout.dtype,
               "--fingerprint", layout.model_fingerprint, "--log-level", "warning",
               *extra_args]
        for opt in options:
            cmd += ["--transport-option", opt]
        self.proc = ManagedProcess(f"{name or role} sidecar ({backend})", cmd, self.socket + ".log",
                                   health_target=self.target).start()
        try:
            self.proc.wait_serving(ready_timeout_s)
        except Exception:
            self.proc.stop()
            raise

    def stop(self) -> None:
        self.proc.stop()


def issue_block_grant(stub: Any, block: Sequence[int], digest: bytes, page_size: int,
                      owner: str, request_id: str) -> Any:
    """A grant (its ``TransferInfo``) over ``block``, the decode sidecar's pages ``owner``
    allocated, for a whole-page prompt of ``len(block)`` pages from token 0 (lease 120 s).
    ``stub``: the decode sidecar's synchronous SidecarServiceStub; timeout 10 s; errors: its
    ``grpc.RpcError``."""
    from deltakv.v1 import kv_pb2, sidecar_pb2

    return stub.IssueGrant(sidecar_pb2.IssueGrantRequest(
        owner_request_id=owner, prompt_digest=digest,
        transfer_info=kv_pb2.TransferInfo(
            request_id=request_id, dst_page_indices=block, decode_prefix_len=0,
            prompt_len=len(block) * page_size, lease_ms=120_000)), timeout=10).transfer_info
