"""The process group: gloo on CPU, NCCL on CUDA, rendezvous over loopback only."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# NOTE: workers wait in a broadcast for the next step, for as long as the server is idle; a
# dead peer is caught by the process monitor, a hung one by the engine's stall watchdog.
IDLE_TIMEOUT = timedelta(days=3650)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_group(rank: int, size: int, port: int, device: torch.device) -> torch.device:
    """Join the group; returns this rank's device (cuda:rank on GPUs)."""
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:   # share the cores: N processes with all cores each would oversubscribe them
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    return device


def agree_on_load(error: Exception | None) -> list[str | None]:
    """Every rank's load failure (None: loaded), gathered on all ranks, so that they decide
    together: a rank that raised alone would leave the others waiting in their first collective,
    or die and take the server down before rank 0 could say why."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else f"{error}")
    return errors
