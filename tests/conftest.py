"""Session set-up shared by every test: the cluster pairing key.

Every deltakv process reads the cluster's pairing key (``--pairing-key-file`` or
``$DELTAKV_PAIRING_KEY_FILE``, docs/architecture.md "Grants and pairing"). The session generates
one key file (mode 0600, in a private temporary directory) and exports its path in
``DELTAKV_PAIRING_KEY_FILE``, so every process a test starts — sidecars, workers, ``deltakv``
commands — belongs to one cluster unless the test says otherwise (``LocalCluster`` passes its
own key with the flag; tests of an unpaired or forged peer use
:func:`tests.support.keys.other_key`).

It also gives the session its own shared-memory name prefix (``$DELTAKV_SHM_PREFIX``,
``deltakv-t<pid>-``): every segment a deltakv process of this session derives a name for (pools
and ``.fence`` segments, local clusters' slots, the transport peer, the MORI stand-in's MR
tables) starts with it, so at the end the session lists exactly what its own processes left in
/dev/shm — other sessions on the host have other prefixes — and fails if anything remains
(removing it). A test that kills a process removes what it left (tests/support/shm.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile

import pytest

from deltakv.sidecar.pairing import KEY_FILE_ENV, generate_key_file

# deltakv.sidecar.pool's PREFIX_ENV and SHM_DIR (not imported: it loads torch).
PREFIX_ENV = "DELTAKV_SHM_PREFIX"
SHM_DIR = "/dev/shm"

_STATE: dict[str, str | None] = {}


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook
    folder = tempfile.mkdtemp(prefix="dkv-key-", dir="/tmp")
    path = os.path.join(folder, "pairing.key")
    generate_key_file(path)
    _STATE.update(folder=folder, previous=os.environ.get(KEY_FILE_ENV),
                  previous_prefix=os.environ.get(PREFIX_ENV))
    os.environ[KEY_FILE_ENV] = path
    os.environ[PREFIX_ENV] = f"deltakv-t{os.getpid()}-"
    # A suite started as a background job (`nohup ... &`) inherits SIGINT ignored, and so would
    # every command the tests start: the Ctrl-C tests need it delivered. Python's handler is
    # reset to the default by exec, so the children get Ctrl-C as from a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def leftover_segments() -> list[str]:
    """Names under /dev/shm with this session's prefix, except the stand-in MR tables of this
    very process (its engines remove them at exit: tests/standins/mori/io/engine.py)."""
    prefix = os.environ[PREFIX_ENV]
    own = f"-{os.getpid()}"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix)
                  and not ("mori-standin-mr-" in n and n.endswith(own)))


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001 - pytest hook
    left = leftover_segments()
    if not left:
        return
    for name in left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = (f"shared-memory segments left behind by this session's processes (removed "
               f"now): {left}")
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config) -> None:  # noqa: ANN001 - pytest hook
    previous = _STATE.get("previous")
    if previous is None:
        os.environ.pop(KEY_FILE_ENV, None)
    else:
        os.environ[KEY_FILE_ENV] = previous
    previous_prefix = _STATE.get("previous_prefix")
    if previous_prefix is None:
        os.environ.pop(PREFIX_ENV, None)
    else:
        os.environ[PREFIX_ENV] = previous_prefix
    if _STATE.get("folder"):
        shutil.rmtree(_STATE["folder"], ignore_errors=True)

