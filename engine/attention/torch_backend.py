"""Plain-torch paged attention: the CPU default and the oracle for the GPU backend.

Each request's KV slots are read from ``req_to_token[req_pool_idx, :seq_len]``; new queries sit
at positions ``prefix_len .. seq_len - 1`` and attend causally (or through ``custom_mask``).
Requests are handled one at a time so a request's arithmetic does not depend on its batch.
"""

from __future__ import annotations

import torch

from engine.runner.forward_batch import ForwardBatch
from engine.scheduler.kv_pool import KVCache, ReqToTokenPool


class TorchBackend:
    def __init__(self, kv_cache: KVCache, req_to_token_pool: ReqToTokenPool):
        self.kv = kv_cache
        self.req_to_token = req_to_token_pool.req_to_token
        self._meta: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        meta, start = [], 0
        for i in range(batch.batch_size):
            ext, seq = batch.extend_seq_lens_cpu[i], batch.seq_lens_cpu[i]
            slots = self.req_to_token[batch.req_pool_indices_cpu[i], :seq].long()
            if batch.custom_mask is not None:
                mask = batch.custom_mask[i]
            elif ext == 1:
                mask = None  # one query at the end sees everything
            else:
                prefix = seq - ext
                q_pos = torch.arange(prefix, seq, device=slots.device).unsqueeze(1)
                mask = torch.arange(seq, device=slots.device).unsqueeze(0) <= q_pos
            meta.append((start, ext, slots, mask))
            start += ext
        self._meta = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        k_buf, v_buf = self.kv.k_buffers[layer_id], self.kv.v_buffers[layer_id]
        k_buf[batch.out_cache_loc] = k.to(k_buf.dtype)
        v_buf[batch.out_cache_loc] = v.to(v_buf.dtype)
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]
        out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
        for start, ext, slots, mask in self._meta:
            qi = q[start:start + ext].transpose(0, 1)  # [H, ext, D]
            ki = k_buf[slots].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            vi = v_buf[slots].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            # plain softmax attention: on CPU it beats SDPA's kernels at these small shapes
            scores = torch.matmul(qi, ki.transpose(1, 2)).mul_(scale)
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(vi.dtype), vi)
            out[start:start + ext] = o.transpose(0, 1).reshape(ext, num_heads * head_dim)
        return out
