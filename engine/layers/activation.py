"""SiLU-and-multiply for the fused gate/up projection."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.cuda_ops import fused_ok


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * d] (gate then up) -> [T, d] = silu(gate) * up. CUDA bf16/fp16 with
        d * itemsize a multiple of 16 bytes: one flashinfer kernel."""
        fi = fused_ok(x)
        if fi is not None and (x.shape[-1] // 2 * x.element_size()) % 16 == 0:
            return fi.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
