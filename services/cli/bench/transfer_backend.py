"""One backend's measurement for ``deltakv bench transfer``: three sidecars, the raw engine and
the control RPC, interleaved, then the small writes and the safety costs.

What each method measures, and why, is described in :mod:`deltakv.services.cli.bench.transfer`;
this module returns the per-backend JSON record that :func:`~deltakv.services.cli.bench.transfer.run`
prints and writes.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from deltakv.services.cli.bench.bench_sidecar import DEFAULT_MODEL, BenchSidecar, bench_layout
from deltakv.services.cli.bench.teardown import tear_down
from deltakv.services.cli.bench.timing import (
    Trial,
    gbps,
    page_write_trial,
    process_cpu_ns,
    time_interleaved,
)


def measure_backend(backend: str, pages: int, page_bytes: int | None, repeats: int,
                    options: list[str], ready_timeout_s: float,
                    model: str = DEFAULT_MODEL, small_pages: tuple[int, ...] = (),
                    small_repeats: int = 20) -> dict[str, Any]:
    """Run the three methods on ``backend``, interleaved, then the small writes of
    ``small_pages`` pages each (sidecar vs raw, interleaved, ``small_repeats`` rounds; sizes
    above ``pages`` are skipped); returns the per-backend JSON record (``page_bytes`` None: one
    page of ``model``, see :func:`bench_layout`)."""
    import grpc
    import torch

    from deltakv.layout import KVLayout
    from deltakv.rpc.command_client import command_socket_path
    from deltakv.rpc.command_stub import CommandStub
    from deltakv.services.cli.bench.safety import FenceProbe, measure_safety_costs
    from deltakv.services.cli.serve.sidecar import parse_options
    from deltakv.sidecar.digests import PageDigester
    from deltakv.sidecar.grants import prompt_digest
    from deltakv.sidecar.pairing import generate_key_file
    from deltakv.sidecar.planner import coalesce
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.sidecar.rooms import RoomTicket
    from deltakv.sidecar.transport.base import TransportOptions
    from deltakv.sidecar.transport.registry import create_transport
    from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

    layout = bench_layout(page_bytes, 2 * pages, model)
    page_bytes = layout.page_bytes
    nbytes = pages * page_bytes
    workdir = tempfile.mkdtemp(prefix="dkv-bench-", dir="/tmp")
    key = generate_key_file(os.path.join(workdir, "pairing.key"))
    digest = prompt_digest([0])  # the "prompt" is the benchmark's random bytes
    sidecars: list[BenchSidecar] = []
    closers: list[Callable[[], None]] = []
    try:
        decode = BenchSidecar("decode", backend, layout, workdir, options, ready_timeout_s)
        sidecars.append(decode)
        prefill = BenchSidecar("prefill", backend, layout, workdir, options, ready_timeout_s)
        sidecars.append(prefill)
        # A second prefill sidecar with digests off: the A/B of what the digests cost.
        plain = BenchSidecar("prefill", backend, layout, workdir, options, ready_timeout_s,
                         extra_args=("--page-digests", "off"), name="prefill-nodigest")
        sidecars.append(plain)
        dec_ch, pre_ch = grpc.insecure_channel(decode.target), grpc.insecure_channel(prefill.target)
        plain_ch = grpc.insecure_channel(plain.target)
        closers += [dec_ch.close, pre_ch.close, plain_ch.close]
        # The workers' transport, the command channel, for every call; gRPC for comparison
        # (``contiguous_grpc``, ``control_rpc_grpc``, the small writes' ``sidecar_grpc``).
        service = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"]
        dec_stub, pre_stub, plain_stub = (CommandStub(command_socket_path(s.socket), service)
                                          for s in (decode, prefill, plain))
        closers += [dec_stub.close, pre_stub.close, plain_stub.close]
        pre_grpc = sidecar_pb2_grpc.SidecarServiceStub(pre_ch)
        dec_desc = dec_stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        pre_desc = pre_stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        plain_desc = plain_stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        dec_pool = SharedKVPool.attach(dec_desc.pool_shm_name,
                                       KVLayout.from_proto(dec_desc.endpoint.layout))
        closers.append(dec_pool.close)
        pre_pool = SharedKVPool.attach(pre_desc.pool_shm_name,
                                       KVLayout.from_proto(pre_desc.endpoint.layout))
        closers.append(pre_pool.close)
        plain_pool = SharedKVPool.attach(plain_desc.pool_shm_name,
                                         KVLayout.from_proto(plain_desc.endpoint.layout))
        closers.append(plain_pool.close)
        src_view, dst_view = pre_pool.as_bytes(), dec_pool.as_bytes()
        # What prefill's worker hashes its delta pages with (supply=True below).
        worker_digests = PageDigester(pre_pool)
        # Every decode page belongs to one bench request: grants cover only live pages.
        owned = dec_stub.Allocate(sidecar_pb2.AllocateRequest(
            request_id="bench-dst", num_pages=layout.num_pages), timeout=10).page_indices
        if sorted(owned) != list(range(layout.num_pages)):
            raise RuntimeError("the decode sidecar's pool is not empty")
        grant_rtt: list[float] = []

        def issue(dst: list[int]) -> kv_pb2.TransferInfo:
            return dec_stub.IssueGrant(sidecar_pb2.IssueGrantRequest(
                owner_request_id="bench-dst", prompt_digest=digest,
                transfer_info=kv_pb2.TransferInfo(
                    request_id="bench", dst_page_indices=dst, decode_prefix_len=0,
                    prompt_len=len(dst) * layout.page_size, lease_ms=120_000)),
                timeout=10).transfer_info

        def close(room: int) -> None:
            dec_stub.CloseGrant(sidecar_pb2.CloseGrantRequest(room=room), timeout=10)

        def check_stats(stats: kv_pb2.TransferStats, pages: int, digests: bool,
                        supplied: list[int] | None) -> None:
            """A write's stats as the sidecar must report them: ``pages`` pages' bytes, a
            digest per page when ``digests``, and exactly the ``supplied`` ones if any.
            RuntimeError otherwise."""
            if stats.bytes != pages * page_bytes:
                raise RuntimeError(f"sidecar reported {stats.bytes} bytes for {pages} pages "
                                   f"of {page_bytes} B")
            if len(stats.page_digests) != (pages if digests else 0):
                raise RuntimeError(f"sidecar returned {len(stats.page_digests)} page digests "
                                   f"for {pages} pages (digests {digests})")
            if supplied is not None and list(stats.page_digests) != supplied:
                raise RuntimeError("the sidecar did not return the page digests it was sent")

        def sidecar_trial(stub: Any, source: Any, src: list[int], dst: list[int], seed: int,
                          digests: bool, runs: list[int], cpu_pid: int | None = None,
                          cpu_ms: list[float] | None = None, supply: bool = False) -> Trial:
            """``cpu_pid`` / ``cpu_ms``: the writing sidecar's process and where to put its
            CPU milliseconds per repeat (all its threads, read untimed just before and
            after the action: no other RPC reaches that sidecar in between). ``supply``:
            send the source pages' digests with the write (``source`` must be the prefill
            sidecar's pool, the one ``worker_digests`` reads), taken untimed right after the
            repeat's fresh bytes were written (what prefill's worker does after the forward
            that wrote them); they must come back unchanged."""
            granted: list[kv_pb2.TransferInfo] = []
            supplied: list[list[int]] = [[]]
            cpu0: list[int] = []

            def setup() -> None:
                if supply:
                    supplied[0] = worker_digests.digest(src)
                t0 = time.perf_counter()
                granted.append(issue(dst))
                grant_rtt.append(time.perf_counter() - t0)
                if cpu_pid is not None:
                    cpu0.append(process_cpu_ns(cpu_pid))

            def teardown() -> None:
                if cpu_pid is not None and cpu_ms is not None:
                    cpu_ms.append((process_cpu_ns(cpu_pid) - cpu0[-1]) / 1e6)
                t0 = time.perf_counter()
                close(granted[-1].room)
                grant_rtt[-1] += time.perf_counter() - t0

            def action() -> None:
                stats = stub.WritePages(sidecar_pb2.WritePagesRequest(
                    transfer_info=granted[-1], src_page_indices=src, prompt_digest=digest,
                    page_digests=supplied[0]), timeout=180).stats
                check_stats(stats, len(src), digests, supplied[0] if supply else None)
                runs.append(stats.runs)

            return page_write_trial(source, src, dst_view, dst, action, seed=seed, setup=setup,
                                    teardown=teardown)

        def preposted_trial(src: list[int], dst: list[int], seed: int) -> Trial:
            """The same write pre-posted, as prefill's worker sends it while its forward
            runs (``WritePagesStream``): the call is opened with the write and no page ready
            (checked, planned and admitted by the sidecar from then on) before the source
            pages get their fresh bytes and the worker's digests; timed is only what
            follows the forward: the last part (every page ready, with those digests) and
            the status."""
            granted: list[kv_pb2.TransferInfo] = []
            open_call: list[Any] = [None]  # the repetition's call until its action finishes it
            supplied: list[list[int]] = [[]]

            def digest_step() -> None:
                supplied[0] = worker_digests.digest(src)

            def teardown() -> None:
                if open_call[0] is not None:
                    open_call[0].cancel()  # only a failed repetition left it open
                    open_call[0] = None
                close(granted[-1].room)

            inner = page_write_trial(src_view, src, dst_view, dst, lambda: None, seed=seed,
                                     setup=digest_step, teardown=teardown)

            def prepare() -> None:
                granted.append(issue(dst))
                call = open_call[0] = pre_stub.WritePagesStream.open(timeout=180)
                call.send(sidecar_pb2.WritePagesPart(write=sidecar_pb2.WritePagesRequest(
                    transfer_info=granted[-1], src_page_indices=src, prompt_digest=digest)))
                inner.prepare()  # the "forward": fresh source bytes, then their digests

            def action() -> None:
                call, open_call[0] = open_call[0], None
                stats = call.finish(sidecar_pb2.WritePagesPart(
                    ready_pages=len(src), page_digests=supplied[0])).stats
                check_stats(stats, len(src), True, supplied[0])

            return Trial(prepare, action, inner.verify)

        # Raw engine: this process's own transport over the same source pool, straight to
        # the decode sidecar's endpoint: ONE Transport.write of the same runs the sidecar's
        # planner makes of the same pages (coalesced; the contiguous block is one run, the
        # scattered pages one run each), under a grant issued and closed around each repeat
        # like the sidecar's (shm checks its fence words on every run).
        engine = create_transport(backend, TransportOptions(
            host="127.0.0.1", extra=parse_options(options)))
        closers.append(engine.close)
        engine.register_pool(pre_pool)
        peer = engine.connect(dec_desc.endpoint)
        closers.append(lambda: engine.disconnect(peer))

        def raw_trial(src: list[int], dst: list[int], seed: int,
                      cpu_ms: list[float] | None = None) -> Trial:
            """``cpu_ms``: where to put this process's CPU milliseconds per repeat (every
            thread: an engine's completion poller too), read just around the action."""
            runs = coalesce(src, dst)
            # In batches of at most the engine's limit, like the planner's (shm: 65,536 runs).
            step = engine.limits.max_entries
            batches = [runs[i:i + step] for i in range(0, len(runs), step)]
            granted: list[kv_pb2.TransferInfo] = []
            cpu0: list[float] = []

            def setup() -> None:
                granted.append(issue(dst))
                cpu0.append(time.process_time())

            def action() -> None:
                ticket = RoomTicket(room=granted[-1].room, request_id="bench-raw",
                                    deadline=time.monotonic() + 120.0)
                for batch in batches:
                    engine.write(peer, batch, ticket)

            def teardown() -> None:
                if cpu_ms is not None:
                    cpu_ms.append((time.process_time() - cpu0[-1]) * 1e3)
                close(granted[-1].room)

            return page_write_trial(src_view, src, dst_view, dst, action, seed=seed,
                                    setup=setup, teardown=teardown)

        def control_rpc_trial(src: list[int], dst: list[int], seed: int,
                              stub: Any = pre_stub) -> Trial:
            """An empty unary call to the writing sidecar over ``stub``'s transport
            (``Describe``: the same server, dispatch and threads as ``WritePages``), prepared
            exactly like a
            sidecar write of ``src`` -> ``dst`` (fresh source bytes, zeroed destination,
            a grant issued and closed, the worker's digests taken): what the gRPC hop
            alone costs in the write's own rhythm. A write must not happen, so a
            repetition verifies when the destination is still zero."""
            granted: list[kv_pb2.TransferInfo] = []

            def setup() -> None:
                worker_digests.digest(src)
                granted.append(issue(dst))

            def action() -> None:
                stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)

            # page_write_trial's preparation only: its check (destination == source) is a
            # write's, the opposite of this one's.
            prepare = page_write_trial(src_view, src, dst_view, dst, action, seed=seed,
                                       setup=setup).prepare
            dst_index = torch.tensor(dst, dtype=torch.long)

            def verify() -> bool:
                close(granted[-1].room)
                return not bool(dst_view[dst_index].any())  # still the zeros of prepare

            return Trial(prepare, action, verify)

        contiguous = list(range(pages))
        # Source on even pages ascending, destination on odd pages descending: no two
        # neighbours are consecutive on either side, so every page is its own run.
        scat_src = [2 * i for i in range(pages)]
        scat_dst = [2 * (pages - 1 - i) + 1 for i in range(pages)]
        plain_view = plain_pool.as_bytes()
        runs_contig: list[int] = []
        runs_scat: list[int] = []
        cpu_side: list[float] = []
        cpu_raw: list[float] = []
        # Every method in one interleaved run: each sees the same machine.
        timed = time_interleaved(repeats, {
            "contiguous": sidecar_trial(pre_stub, src_view, contiguous, contiguous, 1, True,
                                        runs_contig, prefill.proc.pid, cpu_side, supply=True),
            "contiguous_preposted": preposted_trial(contiguous, contiguous, 11),
            "contiguous_sidecar_hash": sidecar_trial(pre_stub, src_view, contiguous,
                                                     contiguous, 7, True, []),
            "contiguous_nodigest": sidecar_trial(plain_stub, plain_view, contiguous, contiguous,
                                                 4, False, []),
            "scattered": sidecar_trial(pre_stub, src_view, scat_src, scat_dst, 2, True,
                                       runs_scat, supply=True),
            "scattered_nodigest": sidecar_trial(plain_stub, plain_view, scat_src, scat_dst, 5,
                                                False, []),
            "raw": raw_trial(contiguous, contiguous, 3, cpu_raw),
            "raw_scattered": raw_trial(scat_src, scat_dst, 6),
            "control_rpc": control_rpc_trial(contiguous, contiguous, 8),
        })
        # gRPC apart, beside a raw write of its own: gRPC's server keeps its polling threads
        # busy for a while after each call, and on a 2-core machine whatever runs next pays
        # for it. Interleaved with the others, a gRPC trial would always run right before
        # the same neighbour (the rounds rotate the order, never change it), which workers,
        # whose calls go over the channel, never see.
        timed |= time_interleaved(repeats, {
            "contiguous_grpc": sidecar_trial(pre_grpc, src_view, contiguous, contiguous, 9,
                                             True, [], supply=True),
            "control_rpc_grpc": control_rpc_trial(contiguous, contiguous, 10, pre_grpc),
            "raw_grpc": raw_trial(contiguous, contiguous, 12),
        })
        t_contig, ok_contig = timed["contiguous"]
        t_contig_off, ok_contig_off = timed["contiguous_nodigest"]
        t_contig_hash, ok_contig_hash = timed["contiguous_sidecar_hash"]
        t_scat, ok_scat = timed["scattered"]
        t_scat_off, ok_scat_off = timed["scattered_nodigest"]
        t_raw, ok_raw = timed["raw"]
        t_raw_scat, ok_raw_scat = timed["raw_scattered"]
        t_rpc, ok_rpc = timed["control_rpc"]
        t_grpc, ok_grpc = timed["contiguous_grpc"]
        t_rpc_grpc, ok_rpc_grpc = timed["control_rpc_grpc"]
        t_raw_grpc, ok_raw_grpc = timed["raw_grpc"]
        t_pre, ok_pre = timed["contiguous_preposted"]
        # Small writes (issue 14: a delta of a few pages): the sidecar's fixed cost per
        # WritePages is its time minus the raw engine's for the same pages, interleaved.
        small: dict[str, dict[str, Any]] = {}
        small_ok = True
        for n in small_pages:
            if n > pages:
                continue
            block_n = list(range(n))
            pair = time_interleaved(small_repeats, {
                "sidecar": sidecar_trial(pre_stub, src_view, block_n, block_n, 10 + n, True, [],
                                         supply=True),
                "sidecar_preposted": preposted_trial(block_n, block_n, 40 + n),
                "raw": raw_trial(block_n, block_n, 20 + n)})
            # gRPC apart, with its own raw write (as for the 64-page write above).
            pair |= time_interleaved(small_repeats, {
                "sidecar_grpc": sidecar_trial(pre_grpc, src_view, block_n, block_n, 30 + n, True,
                                              [], supply=True),
                "raw_grpc": raw_trial(block_n, block_n, 50 + n)})
            (t_side, ok_side), (t_eng, ok_eng) = pair["sidecar"], pair["raw"]
            t_side_grpc, ok_side_grpc = pair["sidecar_grpc"]
            t_eng_grpc, ok_eng_grpc = pair["raw_grpc"]
            t_side_pre, ok_side_pre = pair["sidecar_preposted"]
            ok_n = ok_side and ok_eng and ok_side_grpc and ok_side_pre and ok_eng_grpc
            small_ok = small_ok and ok_n
            small[str(n)] = {"sidecar_ms": t_side * 1e3, "raw_ms": t_eng * 1e3,
                             "fixed_ms": (t_side - t_eng) * 1e3,
                             "sidecar_grpc_ms": t_side_grpc * 1e3,
                             "raw_grpc_ms": t_eng_grpc * 1e3,
                             "fixed_grpc_ms": (t_side_grpc - t_eng_grpc) * 1e3,
                             "sidecar_preposted_ms": t_side_pre * 1e3,
                             "fixed_preposted_ms": (t_side_pre - t_eng) * 1e3, "verified": ok_n}

        # Safety costs, beside the write they protect.
        fence_view = None
        if getattr(engine, "fence_kind", "") == "words":
            armed = issue([0])
            fence_view = FenceProbe(peer.fence, armed.room)
        try:
            costs = measure_safety_costs(pages, key, dec_desc.endpoint, fence_view)
        finally:
            if fence_view is not None:
                close(armed.room)
        raw = gbps(nbytes, t_raw)
        t_contig_us = t_contig * 1e6
        return {
            "page_bytes": page_bytes,
            "pages": pages,
            "bytes": nbytes,
            "raw_gbps": raw,
            "contiguous_gbps": gbps(nbytes, t_contig),
            "scattered_gbps": gbps(nbytes, t_scat),
            "raw_scattered_gbps": gbps(nbytes, t_raw_scat),
            "contiguous_ratio": gbps(nbytes, t_contig) / raw,
            # Like for like: the sidecar's scattered write against the raw engine writing
            # the same scattered runs (one engine request per run on both sides).
            "scattered_ratio": t_raw_scat / t_scat,
            "scattered_vs_raw_contiguous": gbps(nbytes, t_scat) / raw,
            # CPU per contiguous write (median over the repeats, warm-up included): the
            # writing sidecar's whole process against this process's around the raw write.
            "sidecar_cpu_ms": statistics.median(cpu_side),
            "raw_cpu_ms": statistics.median(cpu_raw),
            "contiguous_ms": t_contig * 1e3,
            # The same write pre-posted (opened before its bytes were written, timed from
            # its last part): what prefill's write costs after its forward.
            "preposted_ms": t_pre * 1e3,
            "preposted_ratio": t_raw / t_pre,
            "raw_ms": t_raw * 1e3,
            # Where the contiguous write's time goes beyond the engine: the hop alone (an
            # empty call to the same sidecar over the command channel, prepared like a
            # write) and the rest, the sidecar's own work (checks, admission, fences, stats)
            # as a difference of medians (noise can make it negative).
            # ``rpc_ceiling_ratio`` is the best ratio any handler behind this hop could
            # reach here.
            "control_rpc_ms": t_rpc * 1e3,
            "sidecar_own_ms": (t_contig - t_raw - t_rpc) * 1e3,
            "rpc_ceiling_ratio": t_raw / (t_raw + t_rpc),
            # The same write and the same empty call over gRPC (``--sidecar-channel grpc``).
            "contiguous_grpc_ms": t_grpc * 1e3,
            "contiguous_grpc_ratio": t_raw_grpc / t_grpc,
            "control_rpc_grpc_ms": t_rpc_grpc * 1e3,
            "rpc_ceiling_ratio_grpc": t_raw_grpc / (t_raw_grpc + t_rpc_grpc),
            "raw_grpc_ms": t_raw_grpc * 1e3,
            "contiguous_runs": runs_contig[-1],
            "scattered_runs": runs_scat[-1],
            "grant_check_us": costs["grant_check_us"],
            "grant_check_pct": 100.0 * costs["grant_check_us"] / t_contig_us,
            "fence_kind": getattr(engine, "fence_kind", ""),
            "fence_us_per_run": costs.get("fence_us_per_run", 0.0),
            "fence_pct_contiguous": 100.0 * costs.get("fence_us_per_run", 0.0)
            * runs_contig[-1] / t_contig_us,
            "fence_pct_scattered": 100.0 * costs.get("fence_us_per_run", 0.0)
            * runs_scat[-1] / (t_scat * 1e6),
            "grant_rpc_ms": statistics.median(grant_rtt) * 1e3,
            "contiguous_nodigest_gbps": gbps(nbytes, t_contig_off),
            "scattered_nodigest_gbps": gbps(nbytes, t_scat_off),
            # Share of the contiguous write's time the digests add (negative: noise): with
            # the worker's digests, and with the sidecar hashing the sources itself.
            "digest_cost": (t_contig - t_contig_off) / t_contig,
            "contiguous_sidecar_hash_gbps": gbps(nbytes, t_contig_hash),
            "sidecar_hash_cost": (t_contig_hash - t_contig_off) / t_contig_hash,
            "small": small,
            "verified": (ok_contig and ok_scat and ok_raw and ok_raw_scat and ok_contig_off
                         and ok_scat_off and ok_contig_hash and ok_rpc and small_ok and ok_grpc
                         and ok_rpc_grpc and ok_pre and ok_raw_grpc),
        }
    finally:
        tear_down("bench transfer", closers, sidecars, workdir)
