"""Rotary position embedding (rotate-half layout, as HF Llama/Qwen).

``rope_scaling`` type ``llama3`` follows Meta's Llama 3.1 frequency smoothing (the formula in HF
``_compute_llama3_parameters``): long wavelengths are divided by ``factor``, short ones kept, and
the band in between interpolated.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.cuda_ops import ROPE_HEAD_DIMS, fused_ok


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling is None:
        return inv_freq
    factor = rope_scaling["factor"]
    low = rope_scaling.get("low_freq_factor", 1.0)
    high = rope_scaling.get("high_freq_factor", 4.0)
    old_len = rope_scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hk, D] at integer ``positions`` [T]."""

    def __init__(self, head_dim: int, max_position: int, theta: float, rope_scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)
        # flashinfer's layout: float32 [max_position, head_dim] = [cos | sin] of the half angles
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Returns rotated (q, k). CUDA bf16/fp16 with head_dim in (64, 128, 256): one flashinfer
        kernel, in place on q and k (they may be strided views of the fused qkv output)."""
        fi = fused_ok(q)
        if fi is not None and self.head_dim in ROPE_HEAD_DIMS:
            t = q.shape[0]
            q2, k2 = q.reshape(t, -1), k.reshape(t, -1)  # views when the layout allows
            fi.apply_rope_with_cos_sin_cache_inplace(positions, q2, k2, self.head_dim,
                                                     self.cos_sin_cache, is_neox=True)
            return q2.view(q.shape), k2.view(k.shape)
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rot * sin).to(dtype)
