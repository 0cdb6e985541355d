"""The two-host link's pure parts: tc rates, names, addresses, the no-root error."""

from __future__ import annotations

import os

import pytest

from deltakv.errors import InvalidArgument
from deltakv.services import netns
from deltakv.services.cluster import ClusterConfig, ClusterError, LocalCluster


@pytest.mark.parametrize("text,bps", [("1gbit", 10**9), ("10Gbit", 10**10), ("100mbit", 10**8),
                                      ("2.5gbit", 2_500_000_000), ("1000000bit", 10**6)])
def test_parse_rate(text: str, bps: int) -> None:
    assert netns.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["", "1g", "fast", "-1gbit", "1 gbit", "500kbit"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(InvalidArgument):
        netns.parse_rate(text)


def test_plan_names_fit_the_kernel_and_addresses_share_a_slash30() -> None:
    link = netns.TwoHostLink("1gbit")
    assert len(link.decode_if) <= 15 and len(link.prefill_if) <= 15
    assert link.ns.startswith(f"dkl{os.getpid()}x")
    a, b = (int(ip.rsplit(".", 1)[1]) for ip in (link.decode_ip, link.prefill_ip))
    assert b == a + 1 and a // 4 == b // 4 and a % 4 == 1
    assert link.wrap("decode") == [] and link.wrap("prefill")[:3] == ["ip", "netns", "exec"]
    assert link.burst_bytes == 500_000  # 4 ms at 1 Gbit/s
    assert netns.TwoHostLink("10mbit").burst_bytes == 256 * 1024  # the floor
    link.destroy()  # nothing created: a no-op


def test_cluster_refuses_shm_over_a_link(tmp_path) -> None:
    with pytest.raises(ClusterError, match="network transport"):
        LocalCluster(ClusterConfig(transport="shm", link="1gbit", run_dir=str(tmp_path),
                                   decode_port=0, prefill_port=0))


def test_cluster_without_root_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="--link needs root"):
        LocalCluster(ClusterConfig(transport="mooncake", link="1gbit", run_dir=str(tmp_path),
                                   decode_port=0, prefill_port=0))
