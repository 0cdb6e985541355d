"""SharedKVPool within one process: geometry of the views, zero-copy between two mappings,
checksums, reclaim of leftovers, teardown semantics and typed errors."""

from __future__ import annotations

import errno
import gc
import os
import uuid
import zlib
from collections.abc import Iterator

import grpc
import pytest
import torch

from deltakv.errors import InvalidArgument, ResourceExhausted, UnknownEndpoint
from deltakv.layout import KVLayout
from deltakv.sidecar.pool import SHM_DIR, SharedKVPool, reclaim_stale_segments
from tests.support.layouts import TOY_LAYOUT

SMALL = TOY_LAYOUT.with_pages(8)


@pytest.fixture
def name() -> Iterator[str]:
    """A unique segment name; whatever a test leaves behind under it is removed."""
    n = f"deltakv-test-{uuid.uuid4().hex}"
    yield n
    if os.path.exists(os.path.join(SHM_DIR, n)):
        os.unlink(os.path.join(SHM_DIR, n))


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def test_create_gives_zeroed_page_major_views(name: str) -> None:
    with SharedKVPool.create(SMALL, name) as pool:
        assert pool.owner and pool.name == name and exists(name)
        assert pool.nbytes == SMALL.pool_bytes == 8 * 32_768
        assert os.path.getsize(os.path.join(SHM_DIR, name)) == pool.nbytes
        assert tuple(pool.tensor.shape) == (8, 2, 2, 16, 2, 64)
        assert pool.tensor.dtype == torch.float32 and pool.tensor.is_contiguous()
        assert tuple(pool.as_bytes().shape) == (8, 32_768)
        assert pool.as_bytes().dtype == torch.uint8
        assert pool.data_ptr() == pool.as_bytes().data_ptr() == pool.tensor.data_ptr()
        assert int(pool.as_bytes().sum()) == 0
    assert not exists(name)


def test_page_p_is_byte_range_p_times_page_bytes(name: str) -> None:
    with SharedKVPool.create(SMALL, name) as pool:
        pool.tensor[5, 1, 0, 3, 1, 7] = 1.0  # layer 1, K, token 3, head 1, dim 7
        nonzero = torch.nonzero(pool.as_bytes().reshape(-1)).flatten()
        element = ((((1 * 2 + 0) * 16 + 3) * 2 + 1) * 64 + 7) * 4
        assert nonzero.min().item() >= 5 * SMALL.page_bytes + element
        assert nonzero.max().item() < 5 * SMALL.page_bytes + element + 4


def test_attach_maps_the_same_memory(name: str) -> None:
    owner = SharedKVPool.create(SMALL, name)
    peer = SharedKVPool.attach(name, SMALL)
    try:
        assert not peer.owner and peer.data_ptr() != owner.data_ptr()
        owner.tensor[2].fill_(3.5)
        assert torch.equal(peer.tensor[2], torch.full(SMALL.page_shape, 3.5))
        peer.as_bytes()[6, 100] = 42
        assert int(owner.as_bytes()[6, 100]) == 42
        assert owner.page_crc32([2, 6, 0]) == peer.page_crc32([2, 6, 0])
        assert owner.page_crc32([0]) == [zlib.crc32(bytes(SMALL.page_bytes))]
        assert owner.page_crc32([2]) == [zlib.crc32(owner.as_bytes()[2].numpy().tobytes())]
    finally:
        peer.close()
        assert exists(name)  # a peer never unlinks
        owner.close()
    assert not exists(name)


def test_bfloat16_pool(name: str) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16",
                      page_size=4, num_pages=3)
    with SharedKVPool.create(layout, name) as pool:
        assert pool.tensor.dtype == torch.bfloat16
        assert pool.nbytes == 3 * 1 * 2 * 4 * 1 * 8 * 2


def test_create_reclaims_a_leftover_of_the_same_name(name: str) -> None:
    with open(os.path.join(SHM_DIR, name), "wb") as f:
        f.write(b"\xff" * 1000)  # a crashed sidecar's leftover, wrong size and dirty
    with SharedKVPool.create(SMALL, name) as pool:
        assert pool.nbytes == SMALL.pool_bytes
        assert int(pool.as_bytes().sum()) == 0


def test_attach_missing_segment_is_unknown_endpoint(name: str) -> None:
    with pytest.raises(UnknownEndpoint) as err:
        SharedKVPool.attach(name, SMALL)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert name in str(err.value)


def test_attach_with_another_geometry_is_invalid_argument(name: str) -> None:
    with SharedKVPool.create(SMALL, name):
        with pytest.raises(InvalidArgument, match="does not have the size") as err:
            SharedKVPool.attach(name, SMALL.with_pages(9))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # The error never states the size of the file the caller named.
        assert str(SMALL.pool_bytes) not in str(err.value)


@pytest.mark.parametrize("bad", ["", "/abs", "a/b", ".hidden", "-x", "x" * 201, "sp ace", 7])
def test_bad_names_are_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        SharedKVPool.create(SMALL, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        SharedKVPool.attach(bad, SMALL)  # type: ignore[arg-type]


def test_bad_layout_is_invalid_argument(name: str) -> None:
    with pytest.raises(InvalidArgument):
        SharedKVPool.create("toy", name)  # type: ignore[arg-type]
    assert not exists(name)


@pytest.mark.parametrize("pages", [[8], [-1], [1.0], [True]])
def test_crc_of_bad_pages_is_invalid_argument(name: str, pages: list) -> None:
    with SharedKVPool.create(SMALL, name) as pool, pytest.raises(InvalidArgument):
        pool.page_crc32(pages)


def test_close_is_idempotent_and_closed_pool_rejects_use(name: str) -> None:
    pool = SharedKVPool.create(SMALL, name)
    pool.close()
    pool.close()
    assert pool.closed and not exists(name)
    for call in (pool.data_ptr, pool.as_bytes, lambda: pool.page_crc32([0])):
        with pytest.raises(InvalidArgument, match="closed"):
            call()


def test_close_while_a_caller_holds_a_view_does_not_crash(name: str) -> None:
    owner = SharedKVPool.create(SMALL, name)
    peer = SharedKVPool.attach(name, SMALL)
    view = peer.tensor[4]
    peer.close()
    owner.tensor[4].fill_(2.0)
    # The caller's view keeps the mapping alive and still sees the shared memory.
    assert float(view.sum()) == 2.0 * view.numel()
    owner_view = owner.as_bytes()[1]
    owner.close()
    owner_view.fill_(7)  # the name is gone, the memory is not
    assert int(owner_view[0]) == 7
    del view, owner_view
    gc.collect()
    assert not exists(name)


def test_unlink_spares_a_newer_segment_of_the_same_name(name: str) -> None:
    old = SharedKVPool.create(SMALL, name)
    new = SharedKVPool.create(SMALL, name)  # restarted owner reclaims the name
    old.close()
    assert exists(name)  # the stale owner did not remove its successor's segment
    new.close()
    assert not exists(name)


def test_reclaim_stale_segments_removes_only_unmapped_ones(name: str) -> None:
    prefix = name + "-"
    stale = prefix + "stale"
    with open(os.path.join(SHM_DIR, stale), "wb") as f:
        f.write(b"\0" * 4096)
    with SharedKVPool.create(SMALL, prefix + "live") as live:
        assert reclaim_stale_segments(prefix) == [stale]
        assert exists(live.name) and not exists(stale)
    assert reclaim_stale_segments(prefix) == []
    with pytest.raises(InvalidArgument):
        reclaim_stale_segments("")


def test_shm_too_small_is_resource_exhausted_and_leaves_nothing(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # What the kernel answers when /dev/shm (64 MiB in a default container) cannot hold it.
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(ResourceExhausted, match="enlarge /dev/shm") as err:
        SharedKVPool.create(SMALL, name)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not exists(name)
