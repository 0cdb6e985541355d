"""The shm fence words (sidecar/fence_table.py) across real processes: a writer copies only
under its shared kernel lock and only for its room; the owner's proof completes the moment no
writer is inside — at once when the writer is killed, never while it is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltakv.errors import Aborted, Internal, PermissionDenied, UnknownEndpoint
from deltakv.sidecar.fence_table import FenceTable, FenceView, ranges
from tests.support.tickets import ticket

REPO = Path(__file__).resolve().parents[2]

# A writer process: opens the view, holds page `first`'s lock until its stdin closes (or it
# is killed), after printing "inside".
WRITER = """
import sys
sys.path.insert(0, {repo!r})
from deltakv.sidecar.fence_table import FenceView
from tests.support.tickets import ticket
view = FenceView.open({name!r}, 16, ({dev}, {ino}))
with view.hold({first}, 1, ticket(room={room})):
    print("inside", flush=True)
    sys.stdin.read()
print("left", flush=True)
"""


@pytest.fixture
def table() -> Iterator[FenceTable]:
    t = FenceTable.create(f"deltakv-ut-fence-{uuid.uuid4().hex[:10]}.fence", 16)
    yield t
    t.close()


def writer(table: FenceTable, first: int, room: int) -> subprocess.Popen:
    code = WRITER.format(repo=str(REPO), name=table.name, dev=table.inode[0],
                         ino=table.inode[1], first=first, room=room)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "inside"
    return proc


def test_ranges_coalesce_sorted_pages() -> None:
    assert ranges([7, 1, 2, 3, 9, 8]) == [(1, 3), (7, 3)]
    assert ranges([]) == []


def test_writer_holds_only_pages_armed_for_its_room(table: FenceTable) -> None:
    table.arm(5, [2, 3, 4])
    view = FenceView.open(table.name, 16, table.inode)
    try:
        with view.hold(2, 3, ticket(room=5)):
            pass
        with pytest.raises(PermissionDenied, match="page 5 is not granted"), \
                view.hold(4, 2, ticket(room=5)):
            pytest.fail("copied into a page not granted to the room")
        with pytest.raises(PermissionDenied), view.hold(2, 1, ticket(room=6)):
            pytest.fail("copied for another room")
        with pytest.raises(Internal, match="still armed"):
            table.arm(7, [4])  # a page belongs to one grant at a time
        assert table.words([2, 3, 4, 5]) == [5, 5, 5, 0]
    finally:
        view.close()


def test_revoke_is_proven_only_once_the_writer_left(table: FenceTable) -> None:
    table.arm(9, [0, 1])
    view = FenceView.open(table.name, 16, table.inode)
    inside, release = threading.Event(), threading.Event()

    def copy() -> None:
        with view.hold(0, 2, ticket(room=9)):
            inside.set()
            release.wait(10)

    th = threading.Thread(target=copy)
    th.start()
    assert inside.wait(10)
    table.revoke(9, [0, 1])
    assert table.try_prove(ranges([0, 1])) == [(0, 2)]  # a copy is running
    release.set()
    th.join(10)
    assert table.try_prove(ranges([0, 1])) == []
    # ... and nobody gets in any more.
    with pytest.raises(PermissionDenied), view.hold(0, 1, ticket(room=9)):
        pytest.fail("wrote after the revocation")
    view.close()


def test_a_waiting_writer_stops_on_abort(table: FenceTable) -> None:
    import fcntl

    from deltakv.sidecar.fence_table import _ofd_lock

    table.arm(3, [4])
    view = FenceView.open(table.name, 16, table.inode)
    fd = os.open(f"/dev/shm/{table.name}", os.O_RDWR)
    try:
        assert _ofd_lock(fd, fcntl.F_WRLCK, 4 * 8, 8)  # the owner "holds" the range
        t = ticket(room=3)
        t.abort_event.set()
        with pytest.raises(Aborted), view.hold(4, 1, t):
            pytest.fail("entered while the owner held the range")
    finally:
        os.close(fd)
        view.close()


@pytest.mark.timeout(60)
def test_killed_writer_frees_at_once_stopped_writer_keeps_the_pages(table: FenceTable) -> None:
    table.arm(11, [6])
    table.arm(12, [8])
    killed = writer(table, 6, 11)
    stopped = writer(table, 8, 12)
    try:
        table.revoke(11, [6])
        table.revoke(12, [8])
        assert table.try_prove([(6, 1), (8, 1)]) == [(6, 1), (8, 1)]
        killed.kill()
        killed.wait(10)
        assert table.try_prove([(6, 1)]) == []  # the kernel dropped its lock
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        assert table.try_prove([(8, 1)]) == [(8, 1)]  # no timer frees it
        stopped.send_signal(signal.SIGCONT)
        stopped.stdin.close()  # it finishes its copy and leaves
        assert stopped.stdout.readline().strip() == "left"
        assert table.try_prove([(8, 1)]) == []
    finally:
        for proc in (killed, stopped):
            proc.kill()
            proc.wait(10)


def test_view_refuses_anything_but_the_published_segment(table: FenceTable) -> None:
    with pytest.raises(UnknownEndpoint, match="not the one the peer published"):
        FenceView.open(table.name, 16, (table.inode[0], table.inode[1] + 1))
    with pytest.raises(UnknownEndpoint, match="not the one"):
        FenceView.open(table.name, 17, table.inode)  # another size, not stated
    with pytest.raises(UnknownEndpoint, match="not available"):
        FenceView.open("deltakv-ut-no-such.fence", 16, table.inode)


def test_close_unlinks_and_is_idempotent() -> None:
    t = FenceTable.create(f"deltakv-ut-fence-{uuid.uuid4().hex[:10]}.fence", 4)
    path = f"/dev/shm/{t.name}"
    assert os.stat(path).st_mode & 0o777 == 0o600
    t.close()
    t.close()
    assert not os.path.exists(path)
