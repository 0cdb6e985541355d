"""``deltakv chat``: an interactive multi-turn chat against a deltakv cluster.

Reads one user message per line from stdin (interactive or piped; ``/quit`` or EOF ends,
``/reset`` starts a new conversation), keeps the conversation as chat messages (the decode
service applies the model's chat template), streams each answer as it arrives and then prints
what the turn reused and moved, e.g. ``[reused 96/120 prompt tokens, moved 2 pages = 65,536 B,
TTFT 85 ms]``. From the second turn on, the decode service already holds the earlier
conversation, so only the pages of the new text cross from prefill to decode.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import TextIO

from deltakv.client import DEFAULT_REACH_TIMEOUT_S, DEFAULT_TARGET, DecodeClient, GenerateResult
from deltakv.errors import DeltaKVError, InvalidArgument
from deltakv.rpc import tls as tls_files
from deltakv.rpc.tls import TLSFiles
from deltakv.services.cli.argtypes import (
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

DEFAULT_MAX_NEW_TOKENS = 128


def format_turn_stats(result: GenerateResult) -> str:
    """One line of what a turn reused and moved: prompt tokens decode already held (tokens),
    pages and bytes transferred, client-measured TTFT (ms)."""
    u = result.usage
    return (f"[reused {u.cached_tokens}/{u.prompt_tokens} prompt tokens, moved "
            f"{u.transferred_pages} page{'s' if u.transferred_pages != 1 else ''} = "
            f"{u.transferred_bytes:,} B, TTFT {result.client_ttft_ms:.0f} ms]")


class ChatSession:
    """One conversation with a decode service through a connected :class:`DecodeClient`.

    ``messages`` holds the conversation as ``{"role", "content"}`` dicts (an optional system
    message first). ``max_new_tokens`` bounds each answer (tokens, >= 1); ``temperature`` 0 is
    greedy; ``seed`` makes sampled answers reproducible; ``timeout_s`` is the deadline of one
    turn (s). Raises :class:`InvalidArgument` for out-of-range settings.
    """

    def __init__(self, client: DecodeClient, *, system: str | None = None,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
                 top_p: float = 0.0, seed: int | None = None,
                 timeout_s: float | None = None) -> None:
        if max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.client = client
        self.system = system
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.timeout_s = timeout_s
        self.messages: list[dict[str, str]] = []
        self.results: list[GenerateResult] = []
        self.reset()

    def reset(self) -> None:
        """Start a new conversation (keeps the system message)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    async def ask(self, text: str, on_text: Callable[[str], None] | None = None
                  ) -> GenerateResult:
        """Send ``text`` as the next user message, stream the answer (``on_text`` gets each
        chunk's text as it arrives), append the answer to the conversation and return the
        :class:`GenerateResult`.

        Raises :class:`InvalidArgument` for an empty message and the typed error of a failed
        RPC (e.g. :class:`~deltakv.errors.Unavailable`); on any error the conversation
        is left as it was before the call.
        """
        if not text.strip():
            raise InvalidArgument("empty chat message")
        self.messages.append({"role": "user", "content": text})
        try:
            stream = self.client.stream(
                chat=list(self.messages), max_new_tokens=self.max_new_tokens,
                temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                timeout_s=self.timeout_s)
            async with stream:
                async for chunk in stream:
                    if on_text is not None and chunk.text:
                        on_text(chunk.text)
                result = await stream.result()
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": result.text})
        self.results.append(result)
        return result


def _print_text(out: TextIO) -> Callable[[str], None]:
    def emit(text: str) -> None:
        out.write(text)
        out.flush()
    return emit


async def _connect(client: DecodeClient, timeout_s: float) -> None:
    """Fail at once when nothing listens at the target (as ``deltakv generate`` does), then
    wait up to ``timeout_s`` for a service that answers but is still starting."""
    await client.check_reachable(min(timeout_s, DEFAULT_REACH_TIMEOUT_S))
    await client.wait_ready(timeout_s)


def chat_loop(target: str, stdin: TextIO, out: TextIO, *, system: str | None,
              max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
              timeout_s: float, connect_timeout_s: float, tls: TLSFiles | None = None) -> int:
    """Run the chat until ``/quit`` or EOF on ``stdin``; returns the exit code (0, or 2 when
    the service is unreachable — at once when nothing listens there, after at most
    ``connect_timeout_s`` seconds when it answers but is not SERVING; a refused TLS handshake
    included). ``tls``: dial with TLS (see :class:`~deltakv.client.DecodeClient`).

    Lines are read synchronously between turns (a chat is sequential, and a blocking read in
    the main thread keeps Ctrl-C immediate); each turn runs on one event loop that owns the
    client's channel for the whole session. A failed turn prints its typed error and the chat
    continues without that message.
    """
    interactive = stdin.isatty()
    loop = asyncio.new_event_loop()
    client = DecodeClient(target, timeout_s=timeout_s, tls=tls)
    try:
        try:
            loop.run_until_complete(_connect(client, connect_timeout_s))
        except DeltaKVError as exc:
            print(f"deltakv chat: {exc}; is the cluster up (`deltakv up`) and --target its "
                  f"decode address?", file=sys.stderr)
            return 2
        session = ChatSession(client, system=system, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, seed=seed,
                              timeout_s=timeout_s)
        out.write(f"connected to {target}; /quit or EOF ends, /reset starts over\n")
        while True:
            out.write("you> ")
            out.flush()
            line = stdin.readline()
            if not line:
                out.write("\n")
                return 0
            text = line.strip()
            if not interactive:
                out.write(text + "\n")  # echo piped input so the transcript reads naturally
            if text in ("/quit", "/exit"):
                return 0
            if text == "/reset":
                session.reset()
                out.write("(new conversation)\n")
                continue
            if not text:
                continue
            out.write("assistant> ")
            out.flush()
            try:
                result = loop.run_until_complete(session.ask(text, _print_text(out)))
            except DeltaKVError as exc:
                out.write(f"\n[error: {type(exc).__name__}: {exc}]\n")
                continue
            # Mark an answer cut by --max-new-tokens so it is not mistaken for the model's end.
            cut = " [...]" if result.usage.finish_reason == "length" else ""
            out.write(cut + "\n" + format_turn_stats(result) + "\n")
            out.flush()
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv chat``."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="decode service HOST:PORT")
    parser.add_argument("--system", default=None, help="system message of the conversation")
    parser.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS,
                        help="tokens per answer at most")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=fraction, default=0.0, help="nucleus filter (0 = off)")
    parser.add_argument("--seed", type=non_negative_int, default=None, help="sampling seed")
    parser.add_argument("--timeout", type=positive_float, default=300.0, help="deadline per turn (s)")
    parser.add_argument("--connect-timeout", type=positive_float, default=30.0,
                        help="bound on waiting for a service that answers but is still "
                             "starting (s); nothing listening fails at once")
    tls_files.add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``deltakv chat`` (exit 0; 2 for bad flags or an unreachable service)."""
    try:
        return chat_loop(args.target, sys.stdin, sys.stdout, system=args.system,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_p=args.top_p, seed=args.seed, timeout_s=args.timeout,
                         connect_timeout_s=args.connect_timeout,
                         tls=tls_files.files_from_args(args))
    except InvalidArgument as exc:
        print(f"deltakv chat: {exc}", file=sys.stderr)
        return 2
