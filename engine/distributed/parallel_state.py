"""``ParallelState``: the ranks of this process, built once and passed explicitly.

Rank arithmetic follows SGLang's DP attention (shared/reference/sglang-facts.md, section 3.1):
``attn_tp_size = tp_size // dp_size`` when DP attention is on, else ``tp_size``;
``attn_tp_rank = tp_rank % attn_tp_size``; ``attn_dp_rank = tp_rank // attn_tp_size``.
The deployment ``tp_rank`` is what indexes per-rank payloads (weight updates); code that needs
the attention-TP view asks for ``attn_tp_*`` by name. No group is ever patched in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    tp_group: Any = None  # torch.distributed ProcessGroup over all TP ranks (None when tp_size 1)
    cpu_group: Any = None  # gloo group for control messages

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def attn_dp_rank(self) -> int:
        return self.tp_rank // self.attn_tp_size if self.enable_dp_attention else 0

    @property
    def attn_dp_size(self) -> int:
        return self.dp_size if self.enable_dp_attention else 1

    def all_reduce(self, x):
        """Sum ``x`` in place over the TP group (no-op at tp_size 1); returns ``x``."""
        if self.tp_size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x):
        """Concatenate each rank's ``x`` [..., n] along the last dim -> [..., n * tp_size]."""
        if self.tp_size == 1:
            return x
        import torch
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    # ---- control-plane helpers over the gloo CPU group (plain Python objects / ints) ----
    # The payloads are our own ranks' messages (pickled by torch.distributed); the group's
    # address is the deployment's --dist-init-addr, as in SGLang's broadcast_pyobj.

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (others pass anything, e.g. None)."""
        if self.tp_size == 1:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` as a list indexed by ``tp_rank`` on rank ``dst``; None elsewhere."""
        if self.tp_size == 1:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.tp_size if self.tp_rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.cpu_group)
        return out

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` (an int, e.g. KV pages) over all TP ranks, on every rank."""
        if self.tp_size == 1:
            return value
        import torch
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        """Wait until every TP rank gets here (over the CPU group)."""
        if self.tp_size > 1:
            import torch.distributed as dist
            dist.barrier(group=self.cpu_group)
