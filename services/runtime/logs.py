"""structlog set-up shared by every deltakv process, and its one logging dialect.

The dialect: every module logs through structlog with a snake_case event name and key/value
fields (``log.info("write_done", pages=2, bytes=65536)``), never stdlib ``logging`` with a
sentence; tests/unit/test_log_events.py enforces it over all shipped code. Library modules
(``deltakv.*``, ``deltakv.sidecar.*``) call ``structlog.get_logger(__name__)`` and configure
nothing; the entry point calls :func:`configure_logging` once.

JSON lines on stderr by default (console-friendly rendering when stderr is a terminal, or with
``fmt="console"``). Every line carries ``role`` (sidecar/prefill/decode/...) bound at start-up;
request code binds ``request_id`` and ``room`` with :func:`bind_request` so every line about a
request carries them (contextvars, so it works across asyncio tasks). A line logged inside an
OpenTelemetry span also carries ``trace_id`` and ``span_id`` (:func:`add_trace_context`).
"""

from __future__ import annotations

import logging
import sys

import structlog
from opentelemetry import trace

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(role: str, level: str = "info", fmt: str = "auto") -> structlog.BoundLogger:
    """Configure structlog for this process and return a logger bound to ``role``.

    ``level``: debug|info|warning|error. ``fmt``: json|console|auto (console on a TTY).
    Raises ValueError for an unknown level or format.
    """
    if level not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {sorted(_LEVELS)}")
    if fmt not in ("json", "console", "auto"):
        raise ValueError(f"unknown log format {fmt!r}; choose json, console or auto")
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = (structlog.dev.ConsoleRenderer(colors=False) if console
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_context,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(role=role)
    return structlog.get_logger()


def add_trace_context(logger: object, method_name: str, event_dict: dict) -> dict:
    """structlog processor: a line logged while a span is current carries its ``trace_id``
    (32 hex digits) and ``span_id`` (16), the ids an OTLP backend shows, so logs and traces
    join. Nothing is added when no valid span is current (tracing off)."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def bind_request(request_id: str, room: int | None = None) -> None:
    """Bind ``request_id`` (and ``room``) to every later log line of the current task."""
    values: dict[str, object] = {"request_id": request_id}
    if room is not None:
        values["room"] = room
    structlog.contextvars.bind_contextvars(**values)


def get_logger(**bound: object) -> structlog.BoundLogger:
    """A structlog logger with extra bound key/values. Lazy: safe to create at import time,
    before :func:`configure_logging` runs (it resolves the configuration on first use)."""
    return structlog.get_logger(**bound)
