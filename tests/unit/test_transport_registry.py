"""Transport registry: lazy import by name, typed errors for unknown / unavailable backends,
and out-of-tree ``module:Class`` backends."""

from __future__ import annotations

import sys
import textwrap

import grpc
import pytest

from deltakv.errors import Internal, InvalidArgument
from deltakv.sidecar.transport import (
    BACKENDS,
    BackendUnavailable,
    Transport,
    TransportOptions,
    available_backends,
    backend_class,
    create_transport,
)
from deltakv.sidecar.transport.registry import INSTALL_HINTS, unavailable_reason

FAKE_OK = textwrap.dedent("""
    from deltakv.sidecar.transport.base import Transport

    class Fake(Transport):
        name = "fake"

        def __init__(self, options):
            self.options = options

        @classmethod
        def probe(cls):
            return "no device present"

        def register_pool(self, pool): raise NotImplementedError
        def describe(self, endpoint_id, layout): raise NotImplementedError
        def connect(self, peer): raise NotImplementedError
        def write(self, peer, batch, ticket): raise NotImplementedError
        def disconnect(self, peer): raise NotImplementedError
        def close(self): pass

    class NotATransport:
        def __init__(self, options):
            self.options = options
""")


@pytest.fixture
def fake_backends(tmp_path, monkeypatch):
    """Registry entries backed by real modules on a temporary import path."""
    (tmp_path / "dkv_fake_missing_dep.py").write_text(textwrap.dedent("""
        import dkv_no_such_engine_pkg  # the optional dependency that is not installed
        class Fake: ...
    """))
    (tmp_path / "dkv_fake_broken_lib.py").write_text(textwrap.dedent("""
        raise ImportError("libfakeverbs.so.1: cannot open shared object file")
    """))
    (tmp_path / "dkv_fake_ok.py").write_text(FAKE_OK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "fake-missing", "dkv_fake_missing_dep:Fake")
    monkeypatch.setitem(BACKENDS, "fake-broken", "dkv_fake_broken_lib:Fake")
    monkeypatch.setitem(BACKENDS, "fake-ok", "dkv_fake_ok:Fake")
    monkeypatch.setitem(BACKENDS, "fake-noclass", "dkv_fake_ok:Nope")
    monkeypatch.setitem(BACKENDS, "fake-notransport", "dkv_fake_ok:NotATransport")
    monkeypatch.setitem(INSTALL_HINTS, "fake-missing", "pip install fake-engine")
    yield
    for mod in ("dkv_fake_missing_dep", "dkv_fake_broken_lib", "dkv_fake_ok"):
        sys.modules.pop(mod, None)


def test_registry_names_the_three_design_backends():
    assert BACKENDS["shm"] == "deltakv.sidecar.transport.shm:ShmTransport"
    assert BACKENDS["mooncake"] == "deltakv.sidecar.transport.mooncake:MooncakeTransport"
    assert BACKENDS["mori"] == "deltakv.sidecar.transport.mori:MoriTransport"


def test_unknown_backend_is_invalid_argument_listing_known_names():
    with pytest.raises(InvalidArgument) as exc_info:
        create_transport("rdma-magic", TransportOptions())
    assert exc_info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for name in ("mooncake", "mori", "shm"):
        assert name in str(exc_info.value)


def test_missing_dependency_is_backend_unavailable_naming_the_package(fake_backends):
    with pytest.raises(BackendUnavailable) as exc_info:
        create_transport("fake-missing")
    err = exc_info.value
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "dkv_no_such_engine_pkg" in str(err)
    assert "install: pip install fake-engine" in str(err)
    assert "\n" not in str(err)


def test_broken_shared_library_is_backend_unavailable(fake_backends):
    with pytest.raises(BackendUnavailable, match="libfakeverbs.so.1"):
        backend_class("fake-broken")


def test_registry_entry_without_the_class_is_internal(fake_backends):
    with pytest.raises(Internal, match="has no attribute 'Nope'"):
        backend_class("fake-noclass")
    with pytest.raises(Internal, match="not a Transport subclass"):
        backend_class("fake-notransport")


def test_create_passes_options_and_defaults(fake_backends):
    opts = TransportOptions(host="10.0.0.1", extra={"k": 1})
    assert create_transport("fake-ok", opts).options is opts
    assert isinstance(create_transport("fake-ok").options, TransportOptions)


def test_available_backends_reports_reasons_without_raising(fake_backends):
    avail = available_backends()
    assert set(avail) == set(BACKENDS)
    assert "not a Transport" in avail["fake-notransport"]
    assert avail["shm"] is None
    assert avail["fake-ok"] == "no device present"  # the class's own probe
    assert "dkv_no_such_engine_pkg" in avail["fake-missing"]
    assert "libfakeverbs" in avail["fake-broken"]
    assert "has no attribute" in avail["fake-noclass"]


def test_shm_and_mooncake_are_importable_here():
    # Both ship with the dev environment (DESIGN §7); a regression here disables a backend.
    avail = available_backends()
    assert avail["shm"] is None
    assert avail["mooncake"] is None, avail["mooncake"]
    assert issubclass(backend_class("shm"), Transport)
    assert issubclass(backend_class("mooncake"), Transport)


def test_shm_rejects_bad_options():
    with pytest.raises(InvalidArgument, match="max_entries"):
        create_transport("shm", TransportOptions(extra={"max_entries": 0}))


def test_mooncake_rejects_bad_options_before_starting_an_engine():
    with pytest.raises(InvalidArgument, match="protocol"):
        create_transport("mooncake", TransportOptions(extra={"protocol": "carrier-pigeon"}))
    with pytest.raises(InvalidArgument, match="unknown mooncake options"):
        create_transport("mooncake", TransportOptions(extra={"protocl": "tcp"}))
    # Blocks Mooncake would silently replace by random ports (privileged, ephemeral range),
    # and one past 65535: the sidecar's block is 4 ports (two engines, two listeners each).
    for port in (1000, 40000, 32765):
        with pytest.raises(InvalidArgument, match="ignores ports"):
            create_transport("mooncake", TransportOptions(port=port))
    with pytest.raises(InvalidArgument, match="65533-65536, which must lie in 1-65535"):
        create_transport("mooncake", TransportOptions(port=65533))


# ---------------------------------------------------------------------------- module:Class

def test_out_of_tree_module_class_is_imported_and_constructed(fake_backends):
    opts = TransportOptions(extra={"k": 1})
    t = create_transport("dkv_fake_ok:Fake", opts)
    assert type(t).__name__ == "Fake" and t.options is opts
    assert issubclass(backend_class("dkv_fake_ok:Fake"), Transport)
    assert unavailable_reason("dkv_fake_ok:Fake") == "no device present"  # its own probe


def test_out_of_tree_test_wrapper_resolves_like_a_sidecar_would():
    # What the fault tests pass as --transport (the repository root is on the path).
    cls = backend_class("tests.support.faults:FaultyTransport")
    assert cls.__module__ == "tests.support.faults" and issubclass(cls, Transport)


@pytest.mark.parametrize(("name", "fragment"), [
    ("dkv_no_such_module_xyz:Fake", "no module named 'dkv_no_such_module_xyz'"),
    ("dkv_fake_ok:Missing", "has no attribute 'Missing'"),
    ("dkv_fake_ok:NotATransport", "not a Transport subclass"),
    ("dkv_fake_ok:", "unknown transport backend"),
    (":Fake", "unknown transport backend"),
    ("dkv_fake_ok:Fake:extra", "unknown transport backend"),
])
def test_bad_out_of_tree_names_are_invalid_argument(fake_backends, name, fragment):
    with pytest.raises(InvalidArgument) as exc_info:
        create_transport(name)
    assert exc_info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in str(exc_info.value)
    with pytest.raises(InvalidArgument):
        unavailable_reason(name)  # bad input, not a reason a backend is unavailable


def test_out_of_tree_module_with_a_missing_dependency_is_backend_unavailable(fake_backends):
    with pytest.raises(BackendUnavailable, match="dkv_no_such_engine_pkg"):
        backend_class("dkv_fake_missing_dep:Fake")
