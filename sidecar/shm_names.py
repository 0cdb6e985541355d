"""Names of POSIX shared-memory segments: where they live and the prefix deltakv gives them.

Separate from :mod:`deltakv.sidecar.pool` (which maps segments as torch tensors) so that what
only names segments — ``deltakv up`` planning its sidecars' slots — does not import torch.
"""

from __future__ import annotations

import os
import re

from deltakv.errors import InvalidArgument

#: Where Linux keeps POSIX shared-memory objects (``shm_open`` names map to files here).
SHM_DIR = "/dev/shm"

#: Prefix of generated segment names unless ``$DELTAKV_SHM_PREFIX`` says otherwise.
DEFAULT_PREFIX = "deltakv-"
#: Environment variable naming the prefix of every segment name deltakv derives itself (pools,
#: their companions, a local cluster's slots): separates deployments sharing one host's
#: /dev/shm, and lets a test session find what its own processes left behind.
PREFIX_ENV = "DELTAKV_SHM_PREFIX"

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"invalid shared-memory segment name {name!r}: use 1-200 characters from "
            "[A-Za-z0-9._-], not starting with '.' or '-', no leading '/'"
        )
    return name


def shm_prefix() -> str:
    """``$DELTAKV_SHM_PREFIX`` or :data:`DEFAULT_PREFIX`; InvalidArgument if the variable is
    not a valid segment name."""
    return _check_name(os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX)
