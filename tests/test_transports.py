"""The client's front over its transports, without a server: the cluster view, `connect`, pickling.

Every call that reaches a server is tested against real ones (test_server.py
for one node, test_cluster.py for a routed cluster); these check what a
client knows before it sends anything.
"""

from __future__ import annotations

import pickle

from cacheclient import CacheClient, NodeClient, connect
from cacheclient.routing import Router
from cacheclient.transport import OneNode


def test_a_one_server_client_sees_a_cluster_of_that_node() -> None:
    client = CacheClient("127.0.0.1:1", timeout=3.0, token="t")
    cluster = client.cluster
    assert isinstance(client.transport, OneNode)
    placement = cluster.placement()
    assert placement.version == 0 and placement.nodes == ("127.0.0.1:1",)
    assert placement.locate(b"any key") == "127.0.0.1:1"
    node = cluster.node("127.0.0.1:1")
    assert isinstance(node, NodeClient) and node is client.cluster.node("127.0.0.1:1")
    assert (node.timeout, node.token) == (3.0, "t")
    assert cluster.nodes() == {"127.0.0.1:1": node}
    assert cluster.shard is None and not cluster.routed


def test_a_client_of_fixed_nodes_routes_by_a_static_map_and_shares_its_node_clients() -> None:
    client = CacheClient(nodes=["127.0.0.1:1", "127.0.0.1:2"], timeout=4.0)
    cluster = client.cluster
    assert isinstance(client.transport, Router)
    assert cluster.routed and cluster.shard is None
    assert cluster.placement().nodes == ("127.0.0.1:1", "127.0.0.1:2")
    nodes = cluster.nodes()
    assert set(nodes) == {"127.0.0.1:1", "127.0.0.1:2"}
    assert all(nodes[a] is client.cluster.node(a) for a in nodes)  # one client per node, shared
    assert all(n.timeout == 4.0 for n in nodes.values())


def test_connect_passes_a_client_through_and_makes_one_for_an_address() -> None:
    routed = CacheClient(nodes=["127.0.0.1:1"])
    assert connect(routed) is routed
    made = connect("127.0.0.1:3", timeout=2.0, token="x")
    assert made.address == "127.0.0.1:3" and made.timeout == 2.0
    assert made.cluster.node("127.0.0.1:3").token == "x"


def test_clients_pickle_without_their_channels_and_connect_again() -> None:
    for client in (CacheClient("127.0.0.1:1"), CacheClient(nodes=["127.0.0.1:1", "127.0.0.1:2"])):
        node = client.cluster.node("127.0.0.1:1")
        node._connection.get()  # a channel made in this process (lazily; nothing is dialled yet)
        copy = pickle.loads(pickle.dumps(client))
        copied = copy.cluster.node("127.0.0.1:1")
        assert copied is not node and copied._connection.peek() is None
        client.close()


def test_a_node_client_with_metadata_shares_the_channel_and_adds_to_every_call() -> None:
    node = NodeClient("127.0.0.1:1", token="t")
    routed = node.with_metadata((("x-route", "fallback"),))
    assert routed._connection is node._connection
    assert routed._call_kwargs(None)["metadata"][:2] == (("authorization", "Bearer t"), ("x-route", "fallback"))
    assert node._call_kwargs(None)["metadata"][:1] == (("authorization", "Bearer t"),)
