"""Vocab-parallel embedding and LM head: each rank holds ``ceil(vocab / tp)`` rows
(the last shard zero-padded), as in Megatron-LM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import ParallelState


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, ps: ParallelState,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // ps.tp_size)
        self.start = ps.tp_rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        if full.shape[0] != self.vocab_size or full.shape[1] != param.shape[1]:
            raise ValueError(f"shape mismatch: expected ({self.vocab_size}, {param.shape[1]}), "
                             f"got {tuple(full.shape)}")
        n = max(0, min(self.rows, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:n].copy_(full[self.start:self.start + n])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, dim]."""
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0)
        return self.ps.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, dim] -> float32 logits [R, vocab_size] (gathered over ranks)."""
        local = F.linear(hidden, self.weight).float()
        return self.ps.all_gather_last_dim(local)[:, :self.vocab_size]
