"""Session set-up shared by every test: the cluster pairing key.

Every deltakv process reads the cluster's pairing key (``--pairing-key-file`` or
``$DELTAKV_PAIRING_KEY_FILE``, docs/architecture.md "Grants and pairing"). The session generates
one key file (mode 0600, in a private temporary directory) and exports its path in
``DELTAKV_PAIRING_KEY_FILE``, so every process a test starts — sidecars, workers, ``deltakv``
commands — belongs to one cluster unless the test says otherwise (``LocalCluster`` passes its
own key with the flag; tests of an unpaired or forged peer use
:func:`tests.support.keys.other_key`).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from deltakv.sidecar.pairing import KEY_FILE_ENV, generate_key_file

_STATE: dict[str, str | None] = {}


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook
    folder = tempfile.mkdtemp(prefix="dkv-key-", dir="/tmp")
    path = os.path.join(folder, "pairing.key")
    generate_key_file(path)
    _STATE.update(folder=folder, previous=os.environ.get(KEY_FILE_ENV))
    os.environ[KEY_FILE_ENV] = path


def pytest_unconfigure(config) -> None:  # noqa: ANN001 - pytest hook
    previous = _STATE.get("previous")
    if previous is None:
        os.environ.pop(KEY_FILE_ENV, None)
    else:
        os.environ[KEY_FILE_ENV] = previous
    if _STATE.get("folder"):
        shutil.rmtree(_STATE["folder"], ignore_errors=True)

