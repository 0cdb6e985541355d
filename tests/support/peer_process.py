"""A transport peer in another process (``tests/integration/transport_peer.py``), driven over
its stdin/stdout: the destination of the conformance suite, and a writer from another process
for the fence tests (``connect`` + ``write``)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from base64 import b64decode, b64encode
from dataclasses import dataclass, field
from pathlib import Path

from deltakv.layout import KVLayout
from deltakv.sidecar.pool import SHM_DIR
from deltakv.v1 import kv_pb2
from tests.support.shm import remove_leftovers

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 90.0  # importing torch on a busy 2-core CI machine
REPLY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class BackendCase:
    """One backend under test. ``extra``: TransportOptions.extra on both sides; ``env``:
    environment variables for both sides; ``pythonpath``: directories (relative to the repo
    root) put first on the import path of both sides; ``marks``: pytest marks; ``device``:
    where both sides' pools live (``cpu``, or a device name such as the labelled fake
    ``tests.support.fake_device:FakeDevice``)."""

    name: str
    extra: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    pythonpath: tuple[str, ...] = ()
    marks: tuple = ()
    device: str = "cpu"


def _env_for(case: BackendCase) -> dict[str, str]:
    env = dict(os.environ)
    env.update(case.env)
    paths = [str(REPO_ROOT / p) for p in case.pythonpath] + [str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class PeerProcess:
    """A running transport_peer; owned by the fixture that started it (always stopped)."""

    def __init__(self, case: BackendCase, layout: KVLayout, log_path: Path) -> None:
        self.case = case
        self.layout = layout
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        layout_json = json.dumps({k: getattr(layout, k) for k in (
            "num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "num_pages",
            "model_fingerprint")})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.transport_peer", "--backend", case.name,
             "--layout", layout_json, "--extra", json.dumps(case.extra),
             "--device", case.device],
            cwd=REPO_ROOT, env=_env_for(case), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.segment = ""
        try:
            ready = self._reply(STARTUP_TIMEOUT_S)
            self.segment = ready["segment"]
            self.info = kv_pb2.EndpointInfo.FromString(b64decode(ready["endpoint"]))
        except BaseException:
            self.stop()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float = REPLY_TIMEOUT_S, allow_error: bool = False) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"peer did not answer within {timeout} s; log:\n"
                                 f"{self.log_tail()}") from None
        if line is None:
            raise AssertionError(f"peer exited (rc={self.proc.poll()}); log:\n{self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply and not allow_error:
            raise AssertionError(f"peer error: {reply['error']}")
        return reply

    def call_raw(self, **cmd: object) -> None:
        """Send one command without reading its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, **cmd: object) -> dict:
        self.call_raw(**cmd)
        return self._reply()

    def fill(self, seed: int) -> None:
        self.call(op="fill", seed=seed)

    def crcs(self) -> list[int]:
        return self.call(op="crc")["crc"]

    def connect(self, endpoint: kv_pb2.EndpointInfo) -> int:
        """Make the peer's transport connect to ``endpoint`` (it becomes a writer); returns
        the handle number for :meth:`write`."""
        return self.call(op="connect", endpoint=b64encode(endpoint.SerializeToString()).decode()
                         )["peer"]

    def write(self, handle: int, runs: list[tuple[int, int, int]],
              timeout_s: float = 20.0) -> str | None:
        """Write ``(src_page, dst_page, num_pages)`` runs from the peer's pool through
        ``handle`` in one batch; None if the transport reported success, else its error."""
        self.call_raw(op="write", peer=handle, runs=[list(r) for r in runs],
                      timeout_s=timeout_s)
        reply = self._reply(allow_error=True)
        return reply.get("error")

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        return ""

    def kill(self) -> None:
        """SIGKILL (no cleanup runs in the peer), then reap it."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        self._log.close()
        # A killed peer leaves its segments behind (pool, shm fence words, stand-in MR table).
        if self.segment:
            for name in (self.segment, f"{self.segment}.fence"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
        remove_leftovers(self.proc.pid)
