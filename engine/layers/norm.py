"""RMSNorm as in HF Llama: computed in float32, scaled by the weight in the input dtype."""

import torch
from torch import nn

from engine.layers.cuda_ops import fused_ok


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] any float dtype -> same shape and dtype. CUDA bf16/fp16: one flashinfer
        kernel (float32 inside, the weight applied before the final rounding)."""
        fi = fused_ok(x)
        if fi is not None and x.shape[-1] % 8 == 0:
            shape = x.shape
            return fi.rmsnorm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
