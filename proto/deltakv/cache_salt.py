"""The ``cache_salt`` request field: one tenant's prefix cache never serves another's prompt.

Same name and meaning as vLLM's ``cache_salt``: an optional, non-empty string chosen by the
client (one per user, tenant or trust boundary). Requests reuse cached KV pages only when both
the prompt prefix **and** the salt are equal; absent (``""`` on the wire) means the shared
cache of every unsalted request, which is also what a peer that predates the field does.

Where it applies: decode's and prefill's radix indexes (each salt has its own key space,
:mod:`deltakv.sidecar.radix`), the transfer grant's prompt digest
(:func:`deltakv.sidecar.grants.prompt_digest` binds the salt, so a prefill that ignores it is
refused before a byte moves), and decode's chat memory
(:mod:`deltakv.services.decode.chat_reuse`).
"""

from __future__ import annotations

from deltakv.errors import InvalidArgument

#: Characters of a cache salt; longer is INVALID_ARGUMENT at every entry point.
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: object) -> str:
    """Return ``salt`` if it is a str of at most :data:`MAX_CACHE_SALT_CHARS` characters
    (``""`` = no salt); InvalidArgument (INVALID_ARGUMENT, field ``cache_salt``) otherwise."""
    if not isinstance(salt, str):
        raise InvalidArgument(f"cache_salt must be a string, got {type(salt).__name__}",
                              field="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt has {len(salt)} characters; the limit is "
                              f"{MAX_CACHE_SALT_CHARS}", field="cache_salt")
    return salt
