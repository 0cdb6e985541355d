"""SharedKVPool across real processes: zero-copy both ways, a worker exiting never destroys
the owner's pool, and a SIGKILLed owner's leftover is reclaimed by its successor. (The owner
unlinking on a clean stop is the sidecar's job: tests/integration/test_sidecar_process.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltakv.sidecar.pool import SHM_DIR, SharedKVPool, reclaim_stale_segments
from tests.support.layouts import TOY_LAYOUT

REPO = Path(__file__).resolve().parents[2]
LAYOUT = TOY_LAYOUT.with_pages(8)
WAIT_S = 60  # generous bound for a 2-core CI box; a hung child is killed, not waited on

PRELUDE = """
import os, signal, sys, time
import torch
from tests.support.layouts import TOY_LAYOUT
from deltakv.sidecar.pool import SharedKVPool
LAYOUT = TOY_LAYOUT.with_pages(8)
NAME = sys.argv[1]
"""


def run_child(body: str, name: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body), name],
        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Child processes a test starts; any still running at the end are killed."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)


@pytest.fixture
def name() -> Iterator[str]:
    """A unique segment name (tests may derive more names from it as a prefix); everything
    left behind under that prefix is removed."""
    n = f"deltakv-itest-{uuid.uuid4().hex}"
    yield n
    for leftover in os.listdir(SHM_DIR):
        if leftover.startswith(n):
            os.unlink(os.path.join(SHM_DIR, leftover))


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def readline(proc: subprocess.Popen[str]) -> str:
    """Next stdout line of a child (the child's own prints are the only synchronisation)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=WAIT_S)
        raise AssertionError(f"child exited early (rc={proc.returncode}): {err}")
    return line.strip()


@pytest.mark.timeout(120)
def test_worker_writes_are_visible_to_the_owner_and_back(name: str, children: list) -> None:
    owner = SharedKVPool.create(LAYOUT, name)
    try:
        owner.tensor[1].fill_(1.25)
        worker = run_child("""
            pool = SharedKVPool.attach(NAME, LAYOUT)
            print(float(pool.tensor[1].sum()), flush=True)   # sees the owner's write
            pool.tensor[3, 0, 1].fill_(-2.0)                  # layer 0, V of page 3
            print(pool.page_crc32([3])[0], flush=True)
            sys.stdin.readline()                              # owner checked; exit now
            print(float(pool.tensor[5].sum()), flush=True)    # sees the owner's reply
            pool.close()
        """, name)
        children.append(worker)
        assert float(readline(worker)) == 1.25 * owner.tensor[1].numel()
        child_crc = int(readline(worker))
        expected = torch.zeros(LAYOUT.page_shape)
        expected[0, 1] = -2.0
        assert torch.equal(owner.tensor[3], expected)
        assert owner.page_crc32([3]) == [child_crc]
        owner.tensor[5].fill_(0.5)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert float(readline(worker)) == 0.5 * owner.tensor[5].numel()
        assert worker.wait(timeout=WAIT_S) == 0
        # The worker has exited: the pool and its contents are untouched.
        assert exists(name)
        assert owner.page_crc32([3]) == [child_crc]
        again = SharedKVPool.attach(name, LAYOUT)
        assert torch.equal(again.tensor[3], expected)
        again.close()
    finally:
        owner.close()
    assert not exists(name)


@pytest.mark.timeout(120)
def test_worker_killed_never_destroys_the_pool(name: str, children: list) -> None:
    with SharedKVPool.create(LAYOUT, name) as owner:
        worker = run_child("""
            pool = SharedKVPool.attach(NAME, LAYOUT)
            pool.tensor[0].fill_(9.0)
            print("attached", flush=True)
            time.sleep(60)
        """, name)
        children.append(worker)
        assert readline(worker) == "attached"
        worker.kill()
        worker.wait(timeout=WAIT_S)
        assert exists(name)
        assert float(owner.tensor[0].max()) == 9.0


OWNER = """
    pool = SharedKVPool.create(LAYOUT, NAME)
    pool.tensor[2].fill_(4.0)
    print("ready", flush=True)
    time.sleep(60)
"""


def start_owner(name: str, children: list) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(OWNER), name],
        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    children.append(proc)
    assert readline(proc) == "ready"
    return proc


@pytest.mark.timeout(120)
def test_sigkilled_owner_leftover_is_reclaimed(name: str, children: list) -> None:
    owner = start_owner(name, children)
    owner.kill()  # no handler can run: the segment stays behind
    owner.wait(timeout=WAIT_S)
    assert exists(name)
    stale = SharedKVPool.attach(name, LAYOUT)
    assert float(stale.tensor[2].max()) == 4.0
    stale.close()
    # A restarted sidecar under the same configured name starts from a fresh, zeroed pool.
    with SharedKVPool.create(LAYOUT, name) as fresh:
        assert int(fresh.as_bytes().sum()) == 0


@pytest.mark.timeout(120)
def test_reclaim_stale_segments_after_sigkill(name: str, children: list) -> None:
    dead, alive = name + "-dead", name + "-alive"
    killed = start_owner(dead, children)
    running = start_owner(alive, children)
    killed.kill()
    killed.wait(timeout=WAIT_S)
    try:
        assert reclaim_stale_segments(name + "-") == [dead]
        assert exists(alive) and not exists(dead)  # a segment someone maps is never reclaimed
    finally:
        running.kill()
        running.wait(timeout=WAIT_S)
