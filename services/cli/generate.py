"""``deltakv generate``: one generation.

``--local`` runs the paged model runner aggregated in this process (prefill and decode on one
private pool, no sidecar, no transfer): the reference that disaggregated runs are compared
against. ``--target HOST:PORT`` sends the same request to a cluster's decode service (the
cluster applies the chat template). The prompt is wrapped in the model's chat template unless
``--raw``. Output is the generated text, or with ``--json`` ``{"prompt_token_ids", "token_ids",
"text", "finish_reason"}`` (plus ``"usage"`` with ``--target``); ``token_ids`` includes the EOS
token when generation stopped on one.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``deltakv generate``."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true",
                       help="run the paged runner in this process (aggregated reference)")
    where.add_argument("--target", metavar="HOST:PORT",
                       help="send the request to a cluster's decode service")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="deadline of the request with --target (seconds)")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 | tiny-random | HF model dir | .gguf file (default smollm2)")
    parser.add_argument("--prompt", required=True, help="user message (or raw text with --raw)")
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="generated tokens at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = no nucleus filter")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past EOS until --max-new-tokens")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (local)")
    parser.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="KV pool dtype (local)")
    from deltakv.services.cli.argtypes import add_cache_argument

    add_cache_argument(parser)  # --local loads converted weights from the cache, as workers do
    parser.add_argument("--json", action="store_true",
                        help="print {prompt_token_ids, token_ids, text, finish_reason[, usage]} "
                             "as JSON")
    from deltakv.rpc.tls import add_client_arguments

    add_client_arguments(parser)


def prompt_ids(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    """Token ids of the prompt: chat-templated (with ``--system`` if given) unless ``--raw``.
    Raises :class:`~deltakv.errors.InvalidArgument` for an empty prompt."""
    from deltakv.errors import InvalidArgument
    from deltakv.services.model.tokenizer import encode_chat, encode_text

    if not args.prompt or not args.prompt.strip():
        raise InvalidArgument("empty prompt")
    if args.raw:
        return encode_text(tokenizer, args.prompt)
    messages = [{"role": "user", "content": args.prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    return encode_chat(tokenizer, messages)


def generate_local(args: argparse.Namespace,
                   on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Generate in this process with the paged runner on a private pool sized for the request
    (``ceil((prompt + max_new_tokens) / page_size)`` pages, owned and freed here).

    ``on_text`` receives each new piece of text as it is decoded. Returns ``{"prompt_token_ids":
    [...], "token_ids": [...], "text": str, "finish_reason": "stop" | "length"}``. Raises
    :class:`~deltakv.errors.InvalidArgument` (INVALID_ARGUMENT) for bad options or
    prompt, :class:`~deltakv.errors.NotFound` when the model's files are missing.
    """
    from deltakv.errors import InvalidArgument
    from deltakv.services.model.loader import load_model
    from deltakv.services.model.sampling import Sampler
    from deltakv.services.model.tokenizer import IncrementalDetokenizer

    if args.max_new_tokens < 1:
        raise InvalidArgument(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.page_size < 1:
        raise InvalidArgument(f"--page-size must be >= 1, got {args.page_size}")
    sampler = Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed)
    from deltakv.services.worker import cache_dir_from_args

    model = load_model(args.model, cache_dir=cache_dir_from_args(args))
    prompt = prompt_ids(args, model.tokenizer)
    detok = IncrementalDetokenizer(model.tokenizer, prompt_ids=prompt)
    emit = on_text or (lambda _piece: None)
    pieces: list[str] = []

    def on_token(token: int) -> None:
        piece = detok.push(token)
        if piece:
            pieces.append(piece)
            emit(piece)

    tokens, reason = generate_ids(model, prompt, args.max_new_tokens, sampler,
                                  page_size=args.page_size, kv_dtype=args.kv_dtype,
                                  ignore_eos=args.ignore_eos, on_token=on_token)
    tail = detok.flush()
    if tail:
        pieces.append(tail)
        emit(tail)
    return {"prompt_token_ids": prompt, "token_ids": tokens, "text": "".join(pieces),
            "finish_reason": reason}


def generate_ids(model: Any, prompt: list[int], max_new_tokens: int, sampler: Any, *,
                 page_size: int = 16, kv_dtype: str = "float32", ignore_eos: bool = False,
                 on_token: Callable[[int], None] | None = None) -> tuple[list[int], str]:
    """The aggregated reference over token ids: ``model`` (a loaded
    :class:`~deltakv.services.model.loader` model) prefills ``prompt`` with the paged runner on
    a private pool of ``ceil((len(prompt) + max_new_tokens) / page_size)`` pages (owned and
    freed here) and decodes until a stop. Returns ``(generated token ids, finish reason)``;
    ``on_token`` sees each token as it is sampled. ``deltakv generate --local`` and the
    benchmarks' output checks both run it."""
    from deltakv.services.model.runner import DecodeSeq, ModelRunner
    from deltakv.services.model.sampling import should_stop

    num_pages = -(-(len(prompt) + max_new_tokens) // page_size)
    runner = ModelRunner(model, model.new_pool(page_size, num_pages, kv_dtype))
    page_table = list(range(num_pages))
    tokens: list[int] = []
    logits = runner.prefill(prompt, page_table, 0)
    while True:
        token = sampler.sample(logits)
        tokens.append(token)
        if on_token is not None:
            on_token(token)
        reason = should_stop(token, len(tokens), max_new_tokens, model.eos_token_ids,
                             ignore_eos)
        if reason:
            return tokens, reason
        seq = DecodeSeq(token_id=token, seq_len=len(prompt) + len(tokens) - 1,
                        page_table=page_table)
        logits = runner.decode_step([seq])[0]


def generate_remote(args: argparse.Namespace,
                    on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Send the request to the decode service at ``args.target`` and stream its answer.

    Same keys as :func:`generate_local` plus ``"usage"`` (the server's accounting: prompt and
    cached tokens, transferred pages and bytes, TTFT, prefill/transfer ms). Raises the typed
    error of the RPC's status (e.g. Unavailable when the cluster is down, InvalidArgument for a
    bad prompt).
    """
    import asyncio
    import dataclasses

    from deltakv.client import DecodeClient
    from deltakv.errors import InvalidArgument
    from deltakv.rpc.tls import files_from_args

    if args.max_new_tokens < 1:
        raise InvalidArgument(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt or not args.prompt.strip():
        raise InvalidArgument("empty prompt")
    if args.raw:
        request: dict[str, Any] = {"text": args.prompt}
    else:
        chat = [{"role": "user", "content": args.prompt}]
        if args.system:
            chat.insert(0, {"role": "system", "content": args.system})
        request = {"chat": chat}
    tls = files_from_args(args)
    emit = on_text or (lambda _piece: None)

    async def call() -> dict[str, Any]:
        async with DecodeClient(args.target, timeout_s=args.timeout_s,
                                tls=tls if tls.any else None) as client:
            stream = client.stream(
                **request, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                echo_prompt_token_ids=True)
            async with stream:
                async for chunk in stream:
                    if chunk.text:
                        emit(chunk.text)
                result = await stream.result()
        usage = dataclasses.asdict(result.usage)
        prompt = list(usage.pop("prompt_token_ids"))
        return {"prompt_token_ids": prompt, "token_ids": result.token_ids, "text": result.text,
                "finish_reason": result.usage.finish_reason, "usage": usage}

    return asyncio.run(call())


def print_result(result: dict[str, Any], as_json: bool, streamed: bool = False) -> None:
    """Print a generation: JSON on one line, or the text (just a newline if it was streamed)."""
    if as_json:
        print(json.dumps(result, ensure_ascii=False))
    elif streamed:
        print(flush=True)
    else:
        print(result["text"], flush=True)


def run(args: argparse.Namespace) -> int:
    """Entry point: 0 on success, 2 on a usage or input error (message on stderr)."""
    from deltakv.errors import DeltaKVError

    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    try:
        if args.target:
            result = generate_remote(args, on_text=stream)
        else:
            result = generate_local(args, on_text=stream)
    except DeltaKVError as exc:
        print(f"deltakv generate: {exc.code.name}: {exc}", file=sys.stderr)
        return 2
    print_result(result, args.json, streamed=stream is not None)
    return 0
