"""``ForwardBatch``: everything one model forward needs, passed as an argument.

Token-major tensors have T = total tokens in the step; request-major ones have B = requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.types import ForwardMode


@dataclass
class ForwardBatch:
    """One forward step.

    - ``input_ids`` [T] int64, ``positions`` [T] int64, ``out_cache_loc`` [T] int64: the KV
      slot each new token's K/V is written to.
    - ``req_pool_indices`` [B] int64: rows of ``req_to_token``; ``seq_lens`` [B] int64: KV length
      of each request after this step; ``extend_prefix_lens`` / ``extend_seq_lens`` [B] int64:
      tokens already in KV before the step / new tokens this step (DECODE: all 1).
      ``*_cpu`` are the same as Python lists, so backends need no device sync to loop.
    - ``logits_indices`` [R] int64: rows of the T tokens whose next-token logits are wanted.
    - ``custom_mask``: optional list of B bool tensors [extend_len, seq_len] (True = attend),
      for tree verification; None = causal.
    - ``global_num_tokens``: per-attention-DP-rank token counts (length ``attn_dp_size``) when
      DP attention is on, else None.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_pool_indices_cpu: list[int]
    custom_mask: list[torch.Tensor] | None = None
    global_num_tokens: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_forward_batch(mode: ForwardMode, input_ids: list[int], positions: list[int],
                        out_cache_loc: list[int], req_pool_indices: list[int],
                        prefix_lens: list[int], extend_lens: list[int],
                        logits_indices: list[int], device: torch.device,
                        custom_mask: list[torch.Tensor] | None = None) -> ForwardBatch:
    """Build a ForwardBatch from Python lists with one host-to-device copy: the eight int64
    fields are packed into one (pinned, on CUDA) host tensor, copied without blocking, and
    split into views on ``device``."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    fields = (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, prefix_lens,
              extend_lens, logits_indices)
    flat = [x for f in fields for x in f]
    host = torch.tensor(flat, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    views = packed.split([len(f) for f in fields])
    return ForwardBatch(
        mode=mode, input_ids=views[0], positions=views[1], out_cache_loc=views[2],
        req_pool_indices=views[3], seq_lens=views[4], extend_prefix_lens=views[5],
        extend_seq_lens=views[6], logits_indices=views[7], seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=list(prefix_lens), extend_seq_lens_cpu=list(extend_lens),
        req_pool_indices_cpu=list(req_pool_indices), custom_mask=custom_mask)
