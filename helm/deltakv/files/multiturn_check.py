"""`helm test` check of a deltakv release: incremental KV transfer works end to end.

Sends a two-turn chat to the decode Service on ONE gRPC channel (one HTTP/2 connection, so both
turns reach the same decode pod and its radix index), and checks that:

* both turns finish and stream at least one token;
* turn 1 moved KV (``transferred_bytes > 0``): prefill and decode really exchanged pages;
* turn 2, whose prompt is turn 1's conversation plus one short user message, reports
  ``cached_tokens > 0`` and moved **fewer** bytes than turn 1 (only the delta pages cross).

Exit status: 0 when every check holds, 1 when a check fails, 2 when the service could not be
reached or an RPC failed (the gRPC code is printed). Every RPC has a deadline (--timeout-s).
Runs with the deltakv image's Python (grpcio and the generated ``deltakv.v1`` stubs).
"""

from __future__ import annotations

import argparse
import sys

# About 400 tokens with common tokenizers: several pages at usual page sizes, so turn 1 moves
# several pages while turn 2 adds one short message (at most a page or two of delta).
SYSTEM_PROMPT = " ".join(
    [
        "You are a concise assistant for a team operating a large language model serving system.",
        "The system splits each request into a prefill phase and a decode phase that run on",
        "different machines, and it moves the attention key and value cache between them in",
        "fixed-size pages. Answer in one short sentence. Do not repeat the question.",
    ]
    * 4
)
TURN_1 = "In one sentence, what is a KV cache page?"
TURN_2 = "And why send only the new pages?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="decode Service HOST:PORT")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="deadline of the readiness wait and of each turn (seconds)")
    parser.add_argument("--tls-ca", default="", help="CA bundle (PEM) when the service uses TLS")
    parser.add_argument("--tls-cert", default="",
                        help="client certificate (PEM) when the service requires one (mTLS)")
    parser.add_argument("--tls-key", default="", help="private key (PEM) of --tls-cert")
    args = parser.parse_args(argv)
    if args.max_new_tokens <= 0 or args.timeout_s <= 0:
        parser.error("--max-new-tokens and --timeout-s must be positive")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key come together")
    if args.tls_cert and not args.tls_ca:
        parser.error("--tls-cert needs --tls-ca (the CA of the service's certificate)")
    return args


def _turn(stub, decode_pb2, kv_pb2, messages, max_new_tokens, timeout_s):
    """One Generate call; returns (generated text, Usage). Raises grpc.RpcError."""
    request = decode_pb2.GenerateRequest(
        request_id="",
        chat=decode_pb2.ChatMessages(
            messages=[decode_pb2.ChatMessage(role=r, content=c) for r, c in messages]
        ),
        sampling=kv_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
    )
    text, usage = [], None
    for response in stub.Generate(request, timeout=timeout_s):
        if response.HasField("chunk"):
            text.append(response.chunk.text)
        elif response.HasField("usage"):
            usage = response.usage
    return "".join(text), usage


def check(turn1, turn2) -> list[str]:
    """Failed checks (empty when all hold) for two (text, Usage) results."""
    failures = []
    for n, (_, usage) in enumerate((turn1, turn2), start=1):
        if usage is None:
            failures.append(f"turn {n}: the stream ended without a Usage message")
        elif usage.completion_tokens == 0:
            failures.append(f"turn {n}: no token was generated")
    if failures:
        return failures
    u1, u2 = turn1[1], turn2[1]
    if u1.transferred_bytes == 0:
        failures.append("turn 1 moved 0 bytes: prefill did not transfer the prompt's KV")
    if u2.cached_tokens == 0:
        failures.append("turn 2 reports cached_tokens=0: decode did not reuse turn 1's pages")
    if u2.transferred_bytes >= u1.transferred_bytes:
        failures.append(
            f"turn 2 moved {u2.transferred_bytes} B, not fewer than turn 1's "
            f"{u1.transferred_bytes} B: the transfer is not incremental"
        )
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import grpc

    from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2

    if args.tls_ca:
        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key),
                                                   read(args.tls_cert))
        channel = grpc.secure_channel(args.target, credentials)
    else:
        channel = grpc.insecure_channel(args.target)
    with channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=args.timeout_s)
        except grpc.FutureTimeoutError:
            print(f"FAIL: {args.target} not reachable within {args.timeout_s} s", file=sys.stderr)
            return 2
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        messages = [("system", SYSTEM_PROMPT), ("user", TURN_1)]
        try:
            turn1 = _turn(stub, decode_pb2, kv_pb2, messages, args.max_new_tokens, args.timeout_s)
            messages += [("assistant", turn1[0]), ("user", TURN_2)]
            turn2 = _turn(stub, decode_pb2, kv_pb2, messages, args.max_new_tokens, args.timeout_s)
        except grpc.RpcError as err:
            print(f"FAIL: Generate failed: {err.code().name}: {err.details()}", file=sys.stderr)
            return 2
    for n, (_, usage) in enumerate((turn1, turn2), start=1):
        if usage is not None:
            print(f"turn {n}: prompt_tokens={usage.prompt_tokens} "
                  f"cached_tokens={usage.cached_tokens} pages={usage.transferred_pages} "
                  f"bytes={usage.transferred_bytes} ttft_ms={usage.ttft_ms:.1f}")
    failures = check(turn1, turn2)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if not failures:
        print("PASS: turn 2 moved fewer KV bytes than turn 1")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
