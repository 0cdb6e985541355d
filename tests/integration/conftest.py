"""Fixtures shared by the integration tests."""

from tests.support.transports import sidecar_transport  # noqa: F401 - the fixture
