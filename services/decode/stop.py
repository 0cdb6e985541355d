"""Stop strings over a stream of text pieces (OpenAI's ``stop``, ``GenerateRequest.stop``).

Generation ends as soon as the streamed text contains a stop string; the stop string and
everything after it is not sent. Because a stop string can straddle two pieces, text that could
still be the beginning of one is held back until the next piece says otherwise (at most
``max(len(stop)) - 1`` characters), the rule of vLLM's and TGI's detokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence

from deltakv.errors import InvalidArgument

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


def check_stop_strings(stops: Sequence[str]) -> list[str]:
    """The stop strings of a request; InvalidArgument (INVALID_ARGUMENT) for more than
    :data:`MAX_STOP_STRINGS`, an empty one, or one longer than :data:`MAX_STOP_CHARS`."""
    stops = list(stops)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(f"a stop string must have 1..{MAX_STOP_CHARS} characters, "
                                  f"got {stop!r}")
    return stops


class StopStrings:
    """Cuts a text stream at the first stop string. ``push(piece)`` returns the text that may
    be sent now; ``hit`` turns True once a stop string appeared (later pushes return ""),
    ``flush()`` returns what was held back at the end of the stream. With no stop strings
    every piece passes through unchanged."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.hit = False
        self._held = ""

    def push(self, piece: str) -> str:
        """Text of ``piece`` (with anything held back before it) that is safe to send."""
        if self.hit:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self._held = ""
            return text[: min(found)]
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self, tail: str = "") -> str:
        """The end of the stream: ``tail`` (e.g. the detokenizer's last text) pushed, then
        whatever was held back (it cannot become a stop string any more)."""
        out = self.push(tail)
        if not self.hit:
            out += self._held
        self._held = ""
        return out
