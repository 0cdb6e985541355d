"""Both transports of a worker's calls to its sidecar, as one parametrized fixture.

``sidecar_transport`` (module scope) runs a module's tests once over gRPC and once over the
command channel: the tests' sync stubs (``SidecarProcess.stub()``) and every
``SidecarClient`` made without an explicit ``channel`` use that transport. Make the module's
sidecar fixture depend on it (``def pair(sidecar_transport: str)``), so each transport gets
fresh sidecars (request ids and rooms of one run never meet the other's), and import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from deltakv.sidecar import client
from tests.integration import sidecar_proc

TRANSPORTS = ["grpc", "channel"]


@contextlib.contextmanager
def stub_transport(name: str) -> Iterator[str]:
    """Within the block, tests' stubs and default sidecar clients use ``name``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sidecar_proc.STUB_TRANSPORT, "name", name)
        patch.setattr(client, "DEFAULT_CHANNEL", name)
        yield name


@pytest.fixture(scope="module", params=TRANSPORTS)
def sidecar_transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """The transport of this run: ``"grpc"`` or ``"channel"``."""
    with stub_transport(request.param) as name:
        yield name
