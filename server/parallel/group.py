"""The process group: gloo on CPU, NCCL on CUDA, rendezvous through a TCP store at the master address.

Within a pod the store listens on loopback at a free port; across pods (`--nnodes`) at
`--master-addr:--master-port`, where node 0's first rank (the engine) hosts it. Ranks are
numbered stage by stage with tensor parallelism innermost (vLLM's order), and each node holds
`world / nnodes` consecutive ranks.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# NOTE: workers wait in a broadcast for the next step, for as long as the server is idle; a
# dead peer is caught by the process monitor (`liveness.py` across nodes), a hung one by the
# engine's stall watchdog.
IDLE_TIMEOUT = timedelta(days=3650)

_tensor_group: dist.ProcessGroup | None = None   # None: the whole group (no pipeline stages)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Topology:
    """How many ranks, how they split into stages and onto nodes, and where they meet."""

    tensor: int
    pipeline: int = 1
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.world % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world} ranks cannot be spread "
                             f"evenly over {self.nnodes} nodes (--nnodes)")

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nnodes

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tensor, (stage + 1) * self.tensor))


def host_store(topology: Topology) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on the master address where that is this host's
    (pods that share one network namespace, as on the local test cluster, then each have their
    own --master-port 29500), else on every address."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((topology.master_addr, topology.master_port))
    except OSError:   # e.g. a name or address of a Service in front of this pod
        listener.bind(("", topology.master_port))
    listener.listen(128)
    store = dist.TCPStore(topology.master_addr, topology.master_port, topology.world, is_master=True,
                          timeout=IDLE_TIMEOUT, wait_for_workers=False, master_listen_fd=listener.detach())
    return store


def init_group(rank: int, topology: Topology, device: torch.device, store: dist.TCPStore | None = None
               ) -> tuple[torch.device, dist.TCPStore]:
    """Join the group; returns this rank's device (cuda:local rank on GPUs) and the rendezvous
    store (rank 0 hosts it: passed in when it was created first)."""
    global _tensor_group
    local_rank, local_size = rank % topology.ranks_per_node, topology.ranks_per_node
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:   # share the cores: N processes with all cores each would oversubscribe them
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_size))
    if store is None:
        store = dist.TCPStore(topology.master_addr, topology.master_port, topology.world, is_master=rank == 0,
                              timeout=IDLE_TIMEOUT, wait_for_workers=False)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=topology.world, timeout=IDLE_TIMEOUT)
    _tensor_group = None
    if topology.pipeline > 1:   # every rank creates every stage's group, in the same order
        groups = [dist.new_group(topology.stage_ranks(stage)) for stage in range(topology.pipeline)]
        _tensor_group = groups[rank // topology.tensor]
    return device, store


def tensor_group() -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group (its pipeline stage's ranks); None = the default group."""
    return _tensor_group


def agree_on_load(error: Exception | None) -> list[str | None]:
    """Every rank's load failure (None: loaded), gathered on all ranks, so that they decide
    together: a rank that raised alone would leave the others waiting in their first collective,
    or die and take the server down before rank 0 could say why."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else f"{error}")
    return errors
