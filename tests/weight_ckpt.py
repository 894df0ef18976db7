"""Checkpoint "B" for weight-update tests: a perturbed float32 copy of a checkpoint, and a
gloo trainer helper. Kept free of ``transformers`` imports (fast on a 2-core CI box)."""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import save_file

from engine.weights.loader import iter_weights


def perturbed_weights(src: str, scale: float = 0.15, seed: int = 1) -> dict[str, torch.Tensor]:
    """Every tensor of ``src`` as float32 plus ``scale * std * N(0, 1)`` noise (seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in iter_weights(src, "auto"):
        t = t.float()
        noise = torch.randn(t.shape, generator=g)
        out[name] = (t + scale * (t.std() if t.numel() > 1 else 1.0) * noise).contiguous()
    return out


def write_checkpoint(src: str, dst: str, weights: dict[str, torch.Tensor]) -> str:
    """``dst`` = ``src``'s config/tokenizer files + ``weights`` as model.safetensors."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and not f.endswith(".index.json") and \
                os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    save_file(weights, os.path.join(dst, "model.safetensors"))
    return dst


def make_checkpoint_b(src: str, dst: str, scale: float = 0.15, seed: int = 1) -> str:
    """Write the perturbed copy of ``src`` to ``dst`` (once) and return ``dst``."""
    if not os.path.exists(os.path.join(dst, "model.safetensors")):
        write_checkpoint(src, dst, perturbed_weights(src, scale, seed))
    return dst
