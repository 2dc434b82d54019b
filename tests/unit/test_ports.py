"""Ports for the embedded services: a Redis Cluster node needs its port and the port
10,000 above it (its cluster bus) free, and its port no higher than 55535; the
kernel's own picks may all lie above that (CI drew three in a row)."""

from __future__ import annotations

import socket

from alma_core.cli.embedded import CLUSTER_BUS_OFFSET, RedisClusterNode
from alma_core.cli.embedded_process import free_port_pair


def test_a_pair_is_in_bounds_and_both_ports_bind(tmp_path) -> None:
    for _ in range(20):
        port = free_port_pair(CLUSTER_BUS_OFFSET, highest=65535 - CLUSTER_BUS_OFFSET)
        assert port <= 55535
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))


def test_a_cluster_node_draws_its_port_from_the_pairs(tmp_path) -> None:
    node = RedisClusterNode(tmp_path / "node")
    assert all(node._free_port() <= 55535 for _ in range(20))
