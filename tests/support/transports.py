"""Both transports of a worker's calls to its sidecar, as one parametrized fixture.

``sidecar_transport`` runs a test once over gRPC and once over the command channel: the
tests' sync stubs (``SidecarProcess.stub()``) and every ``SidecarClient`` made without an
explicit ``channel`` use that transport. Apply it to a module with
``pytestmark = pytest.mark.usefixtures("sidecar_transport")`` (and import the fixture).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deltakv.sidecar import client
from tests.integration import sidecar_proc

TRANSPORTS = ["grpc", "channel"]


@pytest.fixture(params=TRANSPORTS)
def sidecar_transport(request: pytest.FixtureRequest,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The transport of this run: ``"grpc"`` or ``"channel"``."""
    monkeypatch.setitem(sidecar_proc.STUB_TRANSPORT, "name", request.param)
    monkeypatch.setattr(client, "DEFAULT_CHANNEL", request.param)
    yield request.param
