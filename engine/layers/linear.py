"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader(param, full, shard)``
that receives the full Hugging Face tensor and copies in only this rank's slice.

Column-parallel layers split the output dim across ``tp_size`` ranks; row-parallel layers split
the input dim and all-reduce the partial sums (Megatron-LM's scheme).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import ParallelState


def _param(shape, dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str = "") -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch{' for ' + name if name else ''}: "
                         f"expected {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W [out // tp, in] on each rank; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        assert out_features % ps.tp_size == 0, "output dim must divide tp_size"
        self.ps = ps
        self.out_per_rank = out_features // ps.tp_size
        self.weight = _param((self.out_per_rank, in_features), dtype, self.load_column)
        self.bias = _param((self.out_per_rank,), dtype, self.load_column) if bias else None

    def load_column(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        n = param.shape[0]
        _copy_checked(param.data, full.narrow(0, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of equal input fused in one matmul (gate/up).
    ``shard`` in the loader is the index of the sub-projection."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, ps: ParallelState,
                 dtype: torch.dtype = torch.float32):
        super().__init__(in_features, sum(out_sizes), bias, ps, dtype)
        self.out_sizes = [s // ps.tp_size for s in out_sizes]
        self.weight.weight_loader = self.load_merged
        if self.bias is not None:
            self.bias.weight_loader = self.load_merged

    def load_merged(self, param: nn.Parameter, full: torch.Tensor, shard: int) -> None:
        n = self.out_sizes[shard]
        offset = sum(self.out_sizes[:shard])
        _copy_checked(param.data.narrow(0, offset, n), full.narrow(0, self.ps.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Query heads split across ranks; KV heads split too, or
    replicated when ``tp_size`` exceeds ``num_kv_heads`` (rank r holds KV head
    ``r * num_kv_heads // tp_size``), so every rank's query heads see their own KV head."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 ps: ParallelState, dtype: torch.dtype = torch.float32):
        tp = ps.tp_size
        assert num_heads % tp == 0, "num_attention_heads must divide tp_size"
        assert num_kv_heads % tp == 0 or tp % num_kv_heads == 0
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.total_kv_heads = num_kv_heads
        self.head_dim = head_dim
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, total, bias, ps, dtype)
        self.weight.weight_loader = self.load_qkv
        if self.bias is not None:
            self.bias.weight_loader = self.load_qkv

    @property
    def kv_head_start(self) -> int:
        tp = self.ps.tp_size
        if self.total_kv_heads >= tp:
            return self.ps.tp_rank * self.num_kv_heads
        return self.ps.tp_rank * self.total_kv_heads // tp

    def load_qkv(self, param: nn.Parameter, full: torch.Tensor, shard: str) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard == "q":
            dst, src = param.data.narrow(0, 0, q_size), full.narrow(0, self.ps.tp_rank * q_size, q_size)
        else:
            offset = q_size + (0 if shard == "k" else kv_size)
            dst = param.data.narrow(0, offset, kv_size)
            src = full.narrow(0, self.kv_head_start * d, kv_size)
        _copy_checked(dst, src)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) (+ b) with W [out, in // tp] on each rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        assert in_features % ps.tp_size == 0, "input dim must divide tp_size"
        self.ps = ps
        self.in_per_rank = in_features // ps.tp_size
        self.weight = _param((out_features, self.in_per_rank), dtype, self.load_row)
        self.bias = _param((out_features,), dtype, self.load_bias) if bias else None

    def load_row(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        n = self.in_per_rank
        _copy_checked(param.data, full.narrow(1, self.ps.tp_rank * n, n))

    def load_bias(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        _copy_checked(param.data, full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = self.ps.all_reduce(y)
        return y + self.bias if self.bias is not None else y
