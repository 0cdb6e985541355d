"""Issue 12 on real clusters: admission, cancellation and per-request isolation, one regression
test per kind of fault the issue found, each with exact expected values.

* leaks on cancel — 100 streams cancelled 0-4 ms after their last token leave 0 request
  records, 0 live, 0 locked pages;
* admission that can deadlock — RESOURCE_EXHAUSTED at the admission bound, and SIGTERM stops
  decode at once although requests wait for pages (``test_admission_bound_and_sigterm``);
* waiting requests that block each other — two requests that each continue a cached prefix
  the other must evict both finish;
* prefill refuses what fits — 8 prefill pages, concurrent 4-page prompts all finish (prefill
  queues; decode retries prefill's RESOURCE_EXHAUSTED with a new room);
* one request's bad parameters — INVALID_ARGUMENT up front, its batch-mates finish;
* error texts that echo input — a 100,000-character role is INVALID_ARGUMENT with a clipped
  message; ``request_id`` is limited to 128 characters at the public edge;
* bytes that are not a message — INVALID_ARGUMENT from every RPC of all four processes;
* abandoned streams — ``break`` out of ``async for`` frees the request at once.

Geometry T (tiny-random, page_size 16, page_bytes 32,768); greedy outputs are checked against
the single-process reference.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import pytest

from deltakv.client import DecodeClient
from deltakv.errors import InvalidArgument, ResourceExhausted, Unavailable
from deltakv.rpc.channel import uds_address
from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2_grpc
from tests.e2e.conftest import (
    TOY_PAGE_BYTES,
    make_cluster,
    run,
    stats,
    wait_for_baseline,
)
from tests.e2e.reference import reference_tokens
from tests.support.faults import cluster_options

pytestmark = pytest.mark.timeout(400)

GARBAGE = b"\n\x05ab"  # field 1, length 5, only 2 bytes follow: truncated


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(n)]


async def prefill_stats(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        return await prefill_pb2_grpc.PrefillServiceStub(channel).GetStats(
            kv_pb2.GetStatsRequest(), timeout=10)


def baseline(cluster) -> decode_pb2.DecodeStats:
    """Both pools back to baseline: 0 live requests, 0 live / locked / quarantined pages,
    free + cached == num_pages."""
    s = wait_for_baseline(cluster.decode_address)
    assert s.pool.live_requests == 0 and s.waiting == 0
    p = run(prefill_stats(cluster.prefill_address))
    assert (p.pool.live, p.pool.locked, p.pool.quarantined, p.pool.live_requests,
            p.live_requests) == (0, 0, 0, 0, 0)
    assert p.pool.free + p.pool.cached == p.pool.num_pages
    return s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Decode 96 pages, prefill only 8 (the chart's prefill:decode ratio, shrunk); prefill
    queues at most 2 attempts (so decode's retry path runs)."""
    c = make_cluster(tmp_path_factory, "admission", prefill_num_pages=8,
                     decode_args=["--admission-timeout-s", "20", "--max-batch-size", "8"],
                     prefill_args=["--max-waiting", "2"])
    try:
        yield c
    finally:
        c.stop()


def test_cancel_right_after_the_last_token_leaks_nothing(cluster) -> None:
    """100 streams with max_new_tokens 8, each cancelled 0-4 ms after its 8th token (before
    or while Usage is sent), 10 at a time: before the fix 9 of 100 left their sidecar record
    and a 96-page pool ended with 85 locked + 11 live pages."""
    rng = random.Random(1201)
    before = run(stats(cluster.decode_address))

    async def one(client: DecodeClient, i: int) -> None:
        stream = client.stream(token_ids=tokens(20 + i % 13, rng), max_new_tokens=8,
                               ignore_eos=True, request_id=f"leak-{i}")
        async for _ in stream:
            if len(stream.token_ids) == 8:
                await asyncio.sleep(rng.uniform(0, 0.004))
                stream.cancel()
                break

    async def scenario() -> None:
        async with DecodeClient(cluster.decode_address, timeout_s=60) as client:
            for wave in range(10):
                await asyncio.gather(*(one(client, wave * 10 + k) for k in range(10)))

    run(scenario())
    after = baseline(cluster)
    assert (after.pool.live, after.pool.locked, after.pool.quarantined,
            after.pool.live_requests) == (0, 0, 0, 0)
    assert after.pool.free + after.pool.cached == after.pool.num_pages == 96
    ended = (after.requests_ok - before.requests_ok,
             after.requests_cancelled - before.requests_cancelled,
             after.requests_failed - before.requests_failed)
    assert ended[0] + ended[1] == 100 and ended[2] == 0, ended


def test_prefill_queues_for_its_pages(cluster) -> None:
    """8 prefill pages, six concurrent 64-token prompts (4 pages each): before the fix the
    third failed RESOURCE_EXHAUSTED from prefill at once while decode had 90 free pages. Now
    prefill queues (at most 2 waiting here), decode retries a refused Prefill with a new room,
    and all six finish with the reference tokens, moving 4 pages each."""
    rng = random.Random(1202)
    prompts = [tokens(64, rng) for _ in range(6)]

    async def scenario():
        async with DecodeClient(cluster.decode_address, timeout_s=60) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=4,
                                                          ignore_eos=True) for p in prompts))

    results = run(scenario())
    for prompt, result in zip(prompts, results, strict=True):
        assert (result.usage.cached_tokens, result.usage.transferred_pages,
                result.usage.transferred_bytes) == (0, 4, 4 * TOY_PAGE_BYTES)
        assert result.token_ids == reference_tokens(prompt, 4)
    baseline(cluster)


def test_bad_sampling_is_refused_up_front_and_its_batch_mates_finish(cluster) -> None:
    rng = random.Random(1203)
    good = [tokens(30, rng) for _ in range(3)]
    before = run(stats(cluster.decode_address))

    async def scenario():
        async with DecodeClient(cluster.decode_address, timeout_s=60) as client:
            calls = [client.generate(token_ids=p, max_new_tokens=12, ignore_eos=True)
                     for p in good]
            calls.append(client.generate(token_ids=tokens(30, rng), max_new_tokens=12,
                                         temperature=1e-38, seed=5))
            return await asyncio.gather(*calls, return_exceptions=True)

    *ok, bad = run(scenario())
    assert isinstance(bad, InvalidArgument)
    assert str(bad) == ("temperature must be 0 (greedy) or a finite number >= 0.01, got "
                        "9.999999350456404e-39")
    for prompt, result in zip(good, ok, strict=True):
        assert result.token_ids == reference_tokens(prompt, 12)
    after = baseline(cluster)
    assert after.requests_failed - before.requests_failed == 1


def test_long_bad_field_is_invalid_argument_with_a_clipped_message(cluster) -> None:
    role = "r" * 100_000

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.decode_address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            request = decode_pb2.GenerateRequest(chat=decode_pb2.ChatMessages(
                messages=[decode_pb2.ChatMessage(role=role, content="hi")]))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(request, timeout=30):
                    pass
            return info.value.code(), info.value.details()

    code, details = run(scenario())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == ("unknown chat role '" + "r" * 63 + "... (100002 characters); use one "
                       "of system, user, assistant")


def test_request_id_limit_is_enforced_at_the_public_edge(cluster) -> None:
    """One documented limit (128 characters), checked before anything is allocated: the
    answer does not depend on the server's random suffix any more."""
    rng = random.Random(1204)
    prompt = tokens(20, rng)
    before = run(stats(cluster.decode_address))

    async def scenario():
        async with DecodeClient(cluster.decode_address, timeout_s=60) as client:
            fits = await client.generate(token_ids=prompt, max_new_tokens=2, ignore_eos=True,
                                         request_id="i" * 128)
            with pytest.raises(InvalidArgument) as err:
                await client.generate(token_ids=prompt, max_new_tokens=2, request_id="i" * 129)
            return fits, str(err.value)

    fits, message = run(scenario())
    assert fits.usage.request_id == "i" * 128
    assert message == "request_id has 129 characters; the limit is 128"
    after = baseline(cluster)
    assert (after.requests_ok - before.requests_ok,
            after.requests_failed - before.requests_failed) == (1, 1)


def _garbage_answers(targets: dict[str, list[tuple[str, str]]]) -> dict[str, tuple]:
    """GARBAGE to each (method, kind) of each target: {method: (code, details)}."""
    out = {}
    for target, methods in targets.items():
        with grpc.insecure_channel(target) as channel:
            for method, kind in methods:
                call = getattr(channel, kind)(method)
                try:
                    result = call(iter([GARBAGE]) if kind == "stream_unary" else GARBAGE,
                                  timeout=10)
                    if kind == "unary_stream":
                        list(result)
                    out[f"{target}{method}"] = (grpc.StatusCode.OK, "")
                except grpc.RpcError as err:
                    out[f"{target}{method}"] = (err.code(), err.details())
    return out


def test_bytes_that_are_not_a_message_are_invalid_argument_everywhere(cluster) -> None:
    from deltakv.v1 import decode_pb2 as d
    from deltakv.v1 import prefill_pb2 as p
    from deltakv.v1 import sidecar_pb2 as s

    def methods(module, service: str) -> list[tuple[str, str, str]]:
        desc = module.DESCRIPTOR.services_by_name[service]
        def kind(m) -> str:
            if m.client_streaming:
                return "stream_unary"  # WritePagesStream: its first message is the garbage
            return "unary_stream" if m.server_streaming else "unary_unary"

        return [(f"/{desc.full_name}/{m.name}", kind(m), m.input_type.full_name)
                for m in desc.methods]

    health = [("/grpc.health.v1.Health/Check", "unary_unary",
               "grpc.health.v1.HealthCheckRequest")]
    plan = {cluster.decode_address: methods(d, "DecodeService") + health,
            cluster.prefill_address: methods(p, "PrefillService") + health,
            uds_address(cluster.sockets["decode"]): methods(s, "SidecarService") + health,
            uds_address(cluster.sockets["prefill"]): methods(s, "SidecarService") + health}
    got = _garbage_answers({t: [(m, k) for m, k, _ in ms] for t, ms in plan.items()})
    expected = {f"{t}{m}": (grpc.StatusCode.INVALID_ARGUMENT,
                            f"request body ({len(GARBAGE)} bytes) is not a valid message: "
                            f"DecodeError: Error parsing message with type '{typ}': Wire format "
                            "was corrupt")
                for t, ms in plan.items() for m, _, typ in ms}
    # 2 decode RPCs, 5 prefill RPCs (PrepareGiveBack), 17 sidecar RPCs (grants, audit,
    # states, WritePagesStream) on each sidecar, and each server's health Check
    assert len(expected) == 2 + 5 + 2 * 17 + 4
    assert got == expected
    baseline(cluster)


def test_leaving_a_stream_with_break_frees_the_request_at_once(cluster) -> None:
    rng = random.Random(1205)
    before = run(stats(cluster.decode_address))

    async def scenario() -> float:
        async with DecodeClient(cluster.decode_address, timeout_s=120) as client:
            stream = client.stream(token_ids=tokens(20, rng), max_new_tokens=1400,
                                   ignore_eos=True)
            async for _ in stream:
                if len(stream.token_ids) >= 2:
                    break
            t0 = time.monotonic()
            while True:  # `stream` is still referenced: only the iterator was dropped
                s = await client.get_stats()
                if s.running == 0 and s.pool.live == 0:
                    return time.monotonic() - t0
                assert time.monotonic() - t0 < 5, s
                await asyncio.sleep(0.05)

    freed_after_s = run(scenario())
    assert freed_after_s < 2.0
    after = baseline(cluster)
    assert (after.requests_cancelled - before.requests_cancelled,
            after.requests_ok - before.requests_ok) == (1, 0)


def test_waiting_requests_do_not_block_each_other(tmp_path_factory) -> None:
    """A 9-page decode pool: two 4-page prefixes A and B cached, 1 page free. X continues A
    and Y continues B; each needs 8 pages (prompt 80 + 48 new tokens), so 3 pages of the
    other's prefix must be evicted. Matching first and allocating later, each kept its prefix
    locked while it waited for the other's: both waited out the admission bound although
    either alone fits. Admitting in one step, the first is admitted at once (3 of the other's
    pages evicted), the second once the first ends, reusing the 1 page of its prefix left."""
    rng = random.Random(1206)
    a, b = tokens(64, rng), tokens(64, rng)
    x, y = a + tokens(16, rng), b + tokens(16, rng)
    c = make_cluster(tmp_path_factory, "blocking", num_pages=9,
                     decode_args=["--admission-timeout-s", "20"])
    try:
        async def scenario():
            async with DecodeClient(c.decode_address, timeout_s=60) as client:
                for prefix in (a, b):  # cache A and B: 4 pages each
                    await client.generate(token_ids=prefix, max_new_tokens=1, ignore_eos=True)
                s = await client.get_stats()
                assert (s.pool.cached, s.pool.free) == (8, 1)
                t0 = time.monotonic()
                done = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=48,
                                                              ignore_eos=True) for p in (x, y)))
                return done, time.monotonic() - t0

        (rx, ry), elapsed = run(scenario())
        assert rx.token_ids == reference_tokens(x, 48) and ry.token_ids == reference_tokens(y, 48)
        usages = sorted([(rx.usage.cached_tokens, rx.usage.transferred_bytes),
                         (ry.usage.cached_tokens, ry.usage.transferred_bytes)])
        # The first admitted reuses its 64-token prefix and moves 1 page; the second finds
        # only the first page of its prefix left and moves the other 4.
        assert usages == [(16, 4 * TOY_PAGE_BYTES), (64, TOY_PAGE_BYTES)]
        assert elapsed < 20
        baseline(c)
    finally:
        c.stop()


def _log_time(log_text: str, event: str) -> float:
    """Epoch seconds of the first JSON log line with ``event``."""
    import datetime
    import json

    for line in log_text.splitlines():
        if f'"event": "{event}"' in line:
            stamp = json.loads(line)["timestamp"].rstrip("Z")
            return datetime.datetime.fromisoformat(stamp).replace(
                tzinfo=datetime.timezone.utc).timestamp()
    raise AssertionError(f"no {event} in the log")


def test_admission_bound_and_sigterm(tmp_path_factory) -> None:
    """A holder keeps 89 of 96 decode pages through an 8 s transfer (the prefill sidecar's
    fault wrapper delays its room). A request needing 14 pages gets RESOURCE_EXHAUSTED at the
    2 s admission bound (before the fix: at the client's deadline). Then five more wait, and
    SIGTERM to decode fails them at once with UNAVAILABLE; decode finishes its lifecycle
    within its 2 s drain grace (+1.5 s), fencing the holder's transfer and releasing its pages
    on the way out (its sidecar, which outlives it, holds nothing afterwards), and exits 0 —
    instead of ignoring the signal while requests waited."""
    from deltakv.v1 import sidecar_pb2_grpc

    rng = random.Random(1207)
    c = make_cluster(tmp_path_factory, "bound",
                     decode_args=["--admission-timeout-s", "2", "--lease-ms", "20000",
                                  "--prefill-timeout-ms", "30000", "--drain-timeout-s", "2"],
                     **cluster_options("delay_ms=8000,rooms=1"))
    try:
        async def scenario():
            async with DecodeClient(c.decode_address, timeout_s=60) as client:
                holder = asyncio.ensure_future(client.generate(
                    token_ids=tokens(16, rng), max_new_tokens=1400, ignore_eos=True))
                while (await client.get_stats()).pool.live < 89:
                    await asyncio.sleep(0.05)
                t0 = time.monotonic()
                with pytest.raises(ResourceExhausted) as err:
                    await client.generate(token_ids=tokens(16, rng), max_new_tokens=200)
                bound_s = time.monotonic() - t0
                waiters = [asyncio.ensure_future(client.generate(
                    token_ids=tokens(16, rng), max_new_tokens=200)) for _ in range(5)]
                while (await client.get_stats()).waiting < 5:
                    await asyncio.sleep(0.05)
                t1 = time.monotonic()
                c.proc("decode").send_signal(signal.SIGTERM)
                failed = await asyncio.gather(*waiters, return_exceptions=True)
                failed_s = time.monotonic() - t1
                exit_code = await asyncio.get_running_loop().run_in_executor(
                    None, c.proc("decode").wait, 20)
                await asyncio.gather(holder, return_exceptions=True)
                return bound_s, str(err.value), failed, failed_s, exit_code

        bound_s, message, failed, failed_s, exit_code = run(scenario())
        assert 2.0 <= bound_s < 3.0
        assert message.startswith("no room in the decode pool after waiting 2 s: request ")
        assert [type(f) for f in failed] == [Unavailable] * 5
        assert {str(f) for f in failed} == {"decode is draining"}
        assert failed_s < 1.0
        log_text = c.proc("decode").log_text()
        assert exit_code == 0
        assert _log_time(log_text, "stopped") - _log_time(log_text, "signal_received") < 3.5
        assert '"event": "transfer_aborted"' in log_text

        async def decode_sidecar():
            async with grpc.aio.insecure_channel(uds_address(c.sockets["decode"])) as ch:
                return await sidecar_pb2_grpc.SidecarServiceStub(ch).GetStats(
                    kv_pb2.GetStatsRequest(), timeout=10)

        pool = run(decode_sidecar()).pool
        assert (pool.live_requests, pool.live, pool.locked, pool.quarantined) == (0, 0, 0, 0)
        assert pool.free + pool.cached == 96
    finally:
        c.stop()
