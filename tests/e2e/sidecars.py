"""What the e2e tests read straight from a cluster's sidecars (over their Unix sockets) and
from its processes' health: pool accounting, page checksums, cache audits, health samples."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.rpc.channel import options, uds_address
from deltakv.services.cluster import LocalCluster
from deltakv.sidecar.pool import shm_prefix
from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

ROLES = ("decode", "prefill")


def sidecar_stub(cluster: LocalCluster, role: str) -> tuple[grpc.Channel, sidecar_pb2_grpc.SidecarServiceStub]:
    channel = grpc.insecure_channel(uds_address(cluster.sockets[role]))
    return channel, sidecar_pb2_grpc.SidecarServiceStub(channel)


def sidecar_call(cluster: LocalCluster, role: str, method: str, request, timeout: float = 30.0):
    """One unbound call to a sidecar (no pool incarnation claimed: a test maps no pool)."""
    channel, stub = sidecar_stub(cluster, role)
    try:
        return getattr(stub, method)(request, timeout=timeout)
    finally:
        channel.close()


def pool_stats(cluster: LocalCluster, role: str) -> kv_pb2.PoolStats:
    return sidecar_call(cluster, role, "GetStats", kv_pb2.GetStatsRequest()).pool


def wait_sidecars_clean(cluster: LocalCluster, timeout_s: float = 20.0) -> dict[str, kv_pb2.PoolStats]:
    """Both sidecars with 0 live, 0 locked, 0 quarantined and free + cached == num_pages
    (bounded wait: quarantines run out, cleanups finish); AssertionError with the last
    accounting otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {role: pool_stats(cluster, role) for role in ROLES}
        clean = all(s.live == 0 and s.locked == 0 and s.quarantined == 0
                    and s.free + s.cached == s.num_pages for s in stats.values())
        if clean:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"sidecars not clean after {timeout_s} s: {stats}")
        time.sleep(0.2)


def all_page_checksums(cluster: LocalCluster, role: str = "decode") -> list[int]:
    """CRC32 of every page of a sidecar's pool (PageChecksums)."""
    pages = list(range(pool_stats(cluster, role).num_pages))
    return list(sidecar_call(cluster, role, "PageChecksums",
                             sidecar_pb2.PageChecksumsRequest(page_indices=pages)).crc32)


def audit(cluster: LocalCluster, role: str = "decode", evict: bool = False
          ) -> sidecar_pb2.AuditCacheResponse:
    return sidecar_call(cluster, role, "AuditCache", sidecar_pb2.AuditCacheRequest(evict=evict))


def shm_segments(cluster: LocalCluster) -> set[str]:
    """This cluster's pool segments under /dev/shm."""
    prefix = f"{shm_prefix()}{cluster.cluster_id}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def health_targets(cluster: LocalCluster) -> dict[str, str]:
    """Process name -> the gRPC target its health service answers on."""
    return {"decode": cluster.decode_address, "prefill": cluster.prefill_address,
            "decode-sidecar": uds_address(cluster.sockets["decode"]),
            "prefill-sidecar": uds_address(cluster.sockets["prefill"])}


SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
DOWN = "DOWN"  # no answer: the process is gone or not listening yet


def health_of(channel: grpc.Channel, timeout_s: float = 0.5) -> str:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.RpcError:
        return DOWN
    return SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING


@dataclass
class HealthLog:
    """Health of every process of a cluster, polled every ``interval_s`` on a thread:
    ``samples[name]`` is a list of ``(monotonic time, status)``. Use as a context manager."""

    cluster: LocalCluster
    interval_s: float = 0.1
    samples: dict[str, list[tuple[float, str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-log", daemon=True)

    def __enter__(self) -> HealthLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        targets = health_targets(self.cluster)
        # Probe options: reconnect within 500 ms of a restart (gRPC's default backoff would
        # report a process that is back as down for many seconds).
        channels = {name: grpc.insecure_channel(t, options=options("probe"))
                    for name, t in targets.items()}
        try:
            while not self._stop.is_set():
                for name, channel in channels.items():
                    self.samples.setdefault(name, []).append((time.monotonic(),
                                                              health_of(channel)))
                self._stop.wait(self.interval_s)
        finally:
            for channel in channels.values():
                channel.close()

    def statuses(self, name: str, since: float = 0.0) -> list[str]:
        return [status for t, status in self.samples.get(name, []) if t >= since]

    def outages(self, name: str, min_s: float) -> list[tuple[float, float]]:
        """Maximal periods of at least ``min_s`` in which ``name`` was never SERVING."""
        out, start, last = [], None, None
        for t, status in self.samples.get(name, []):
            if status != SERVING:
                start = t if start is None else start
                last = t
            elif start is not None:
                if last - start >= min_s:
                    out.append((start, last))
                start = None
        if start is not None and last - start >= min_s:
            out.append((start, last))
        return out

    def serving_during(self, name: str, period: tuple[float, float]) -> list[float]:
        """Times ``name`` reported SERVING inside ``period``."""
        return [t for t, status in self.samples.get(name, [])
                if period[0] <= t <= period[1] and status == SERVING]
