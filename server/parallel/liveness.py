"""Across nodes, a group lives or dies whole: node 0 and each headless node hold one TCP
connection open for as long as they run, so either side sees the other go (killed, OOM,
pod deleted) the instant the kernel closes its socket, idle or not: a rank's death cannot
otherwise be seen between steps, when the ranks wait in a broadcast without timeout.

Node 0 listens on an ephemeral port that it publishes in the rendezvous store; a headless
node reads it there, connects and names itself.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

STORE_KEY = "kubeinfer/liveness-port"


def listen(store: dist.TCPStore) -> socket.socket:
    """Node 0: the listening socket, its port published for the other nodes."""
    listener = socket.create_server(("", 0), family=socket.AF_INET)
    store.set(STORE_KEY, str(listener.getsockname()[1]))
    return listener


def connect(master_addr: str, store: dist.TCPStore, node_rank: int) -> socket.socket:
    """A headless node: connect to node 0 (once it has published its port) and name this node."""
    port = int(store.get(STORE_KEY))
    connection = socket.create_connection((master_addr, port))
    connection.sendall(f"{node_rank}\n".encode())
    return connection


def read_node_rank(connection: socket.socket) -> int | None:
    """The node rank a new connection sends first (None: it closed before)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(16)
        if not chunk:
            return None
        data += chunk
    return int(data)
