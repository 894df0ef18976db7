"""SiLU-and-multiply for the fused gate/up projection."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * d] (gate then up) -> [T, d] = silu(gate) * up."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
