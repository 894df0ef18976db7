"""Optional fused GPU kernels from flashinfer (RMSNorm, SiLU-and-mul, RoPE).

On a CUDA tensor in bf16/fp16 the layers call these single kernels instead of a chain of
elementwise torch ops: a Llama decode step at batch 1 runs ~45 small kernels per layer in plain
torch, which alone costs ~3 ms per step on an H200 even inside a CUDA graph. CPU tensors and
float32 keep the plain-torch path (the exact-parity oracle). Sources:
shared/reference/flashinfer-facts.md section 6 (signatures, shape limits).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

ROPE_HEAD_DIMS = (64, 128, 256)


@functools.cache
def flashinfer_module():
    """The ``flashinfer`` module, or None when it is not installed (imported once)."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    import flashinfer
    return flashinfer


def fused_ok(x: torch.Tensor):
    """flashinfer if ``x`` can take a fused kernel (CUDA, half precision), else None."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    return flashinfer_module()
