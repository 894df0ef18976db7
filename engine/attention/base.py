"""The attention backend protocol. Implementations: ``TorchBackend`` (CPU default, the test
oracle) and ``FlashInferBackend`` (GPU)."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.runner.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan once per step (index tensors, masks, wrapper plans) before the layers run."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Write k, v [T, Hkv, D] into the layer's KV at ``batch.out_cache_loc`` and attend with
        q [T, Hq, D] over each request's whole KV (prefix + new tokens) -> [T, Hq * D]."""
