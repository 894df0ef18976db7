"""A private process group between a trainer and the engine ranks, for
``/update_weights_from_distributed`` (sglang-facts.md section 2.4).

The trainer is rank 0 and hosts a ``TCPStore`` at ``master_address:master_port``; engine rank r
joins as rank ``rank_offset + r`` of ``world_size``. The group is built directly from a
``PrefixStore`` + ``ProcessGroupGloo``/``ProcessGroupNCCL``: never
``torch.distributed.init_process_group`` (the engine's default group carries TP) and never a
private c10d helper. Tensors are broadcast from rank 0 with the group's own ``broadcast``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class UpdateGroup:
    """A joined group: ``pg`` is the ProcessGroup, ``store`` keeps the TCP connection alive.
    ``device`` is where received tensors are allocated (cuda for NCCL, cpu for gloo)."""

    name: str
    rank: int
    world_size: int
    backend: str
    pg: Any
    store: Any
    device: torch.device

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast each of ``tensors`` from group rank ``src`` in place (all issued, then
        all waited on). Raises RuntimeError on a timeout or a broken peer."""
        works = []
        for t in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            works.append(self.pg.broadcast([t], opts))
        for w in works:
            w.wait()

    def destroy(self) -> None:
        """Drop the group (NCCL communicators are aborted; gloo sockets close with the object)."""
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "abort", None)
        if self.backend == "nccl" and shutdown is not None:
            try:
                shutdown()
            except Exception:  # already broken: nothing left to release
                pass
        self.pg = self.store = None


def join_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, backend: str, device: torch.device,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> UpdateGroup:
    """Create (rank 0: host the store) or join the group; blocks until all ``world_size``
    members have joined or ``timeout_s`` seconds pass. ``backend`` is "gloo" or "nccl".
    Raises ValueError for bad arguments, RuntimeError/DistStoreError when peers do not come."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of {world_size}")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("backend 'nccl' needs the engine on CUDA; use 'gloo' on CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                          timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"eyrie_weight_update/{group_name}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        dev = torch.device("cpu")
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        dev = device
    return UpdateGroup(group_name, rank, world_size, backend, pg, store, dev)
