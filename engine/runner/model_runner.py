"""``ModelRunner``: owns the model, the KV memory and the attention backend; runs one
``ForwardBatch`` and returns next-token logits."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from engine.config import EngineArgs, ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.runner.forward_batch import ForwardBatch
from engine.scheduler.kv_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from engine.weights.loader import build_model

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOKENS = 65536  # cap for the CPU KV pool when no size is given


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor  # [R, vocab] float32, rows = batch.logits_indices
    hidden_states: torch.Tensor | None = None  # [T, hidden]


def _available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    def __init__(self, args: EngineArgs, model_path: str, model_config: ModelConfig,
                 ps: ParallelState):
        self.args = args
        self.ps = ps
        self.model_config = model_config
        self.device = torch.device(args.resolved_device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = args.torch_dtype(model_config)
        self.context_len = args.context_length or model_config.max_position_embeddings
        t0 = time.perf_counter()
        self.model = build_model(model_path, model_config, args.load_format, ps, self.dtype,
                                 self.device)
        logger.info("Load weight end. Time elapsed: %.2f s, format=%s, dtype=%s",
                    time.perf_counter() - t0, args.load_format, self.dtype)
        self.page_size = args.page_size
        self.max_running_requests = args.max_running_requests or (
            256 if self.device.type == "cuda" else 128)
        # flashinfer kernels take 16-bit q/k/v only: float32 on GPU falls back to torch
        self.backend_name = args.attention_backend or (
            "flashinfer" if self.device.type == "cuda" and self.dtype != torch.float32
            else "torch")
        if self.backend_name == "flashinfer" and self.dtype == torch.float32:
            raise ValueError("--attention-backend flashinfer needs --dtype bfloat16 or float16")
        self.kv_head_dim = model_config.head_dim
        if self.backend_name == "flashinfer":  # kernels run at 64/128/256: pad the cache
            from engine.attention.flashinfer_backend import kv_head_dim
            self.kv_head_dim = kv_head_dim(model_config.head_dim)
        # every TP rank must see the same capacity or their schedulers drift apart
        num_pages = ps.min_over_ranks(self._num_kv_pages())
        attn0 = self.model.model.layers[0].self_attn
        self.kv_cache = KVCache(model_config.num_hidden_layers, num_pages, self.page_size,
                                attn0.num_kv_heads, self.kv_head_dim, self.dtype, self.device)
        self.allocator = TokenToKVPoolAllocator(num_pages, self.page_size)
        # one extra row, reserved (all zeros = the dummy page) for CUDA-graph padding requests
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, self.context_len,
                                                self.device, reserved=1)
        self.padding_row = self.req_to_token_pool.size - 1
        self.attn_backend = self._make_backend()
        logger.info("KV cache: %d tokens (%d pages of %d), %.1f MB", num_pages * self.page_size,
                    num_pages, self.page_size, self._kv_bytes(num_pages) / 2**20)
        self.graph_runner = None
        if (self.backend_name == "flashinfer" and self.device.type == "cuda"
                and not args.disable_cuda_graph):
            from engine.runner.cuda_graph import CudaGraphRunner
            max_bs = min(args.cuda_graph_max_bs or 256, self.max_running_requests)
            self.graph_runner = CudaGraphRunner(self, max_bs, self.padding_row)

    def _kv_bytes(self, num_pages: int) -> int:
        attn0 = self.model.model.layers[0].self_attn
        per_token = KVCache.bytes_per_token(self.model_config.num_hidden_layers,
                                            attn0.num_kv_heads, self.kv_head_dim, self.dtype)
        return per_token * num_pages * self.page_size

    def _num_kv_pages(self) -> int:
        """KV capacity in pages: ``--max-total-tokens`` if given, else a fraction of free
        device memory (``--mem-fraction-static``; CPU: of MemAvailable, capped)."""
        per_page = self._kv_bytes(1)
        if self.args.max_total_tokens:
            return max(1, self.args.max_total_tokens // self.page_size)
        if self.device.type == "cuda":
            # SGLang's meaning: weights + KV take ``frac`` of the device; the rest is left for
            # activations, CUDA graphs and the flashinfer workspace (256 MB + 8 MB per wrapper)
            free, total = torch.cuda.mem_get_info(self.device)
            frac = self.args.mem_fraction_static or 0.85
            budget = free - (1 - frac) * total
            if budget < per_page:
                raise RuntimeError(
                    f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                    f"{total / 2**30:.1f} GiB after loading weights, mem_fraction_static={frac}; "
                    "raise --mem-fraction-static or use a smaller model")
            return int(budget // per_page)
        frac = self.args.mem_fraction_static or 0.3
        pages = int(_available_host_bytes() * frac // per_page)
        return max(1, min(pages, CPU_DEFAULT_MAX_TOKENS // self.page_size))

    def _make_backend(self):
        name = self.backend_name
        if name not in ("flashinfer", "torch"):
            raise ValueError(f"unknown attention backend {name!r} (torch | flashinfer)")
        if name == "flashinfer":
            from engine.attention.flashinfer_backend import FlashInferBackend
            return FlashInferBackend(self)
        from engine.attention.torch_backend import TorchBackend
        return TorchBackend(self.kv_cache, self.req_to_token_pool)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Next-token logits for ``batch``. A DECODE batch of at most ``cuda_graph_max_bs``
        requests replays a CUDA graph (outputs are then views valid until the next forward);
        everything else runs eagerly."""
        self._write_req_to_token(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits, hidden = self.graph_runner.replay(batch)
            return LogitsOutput(logits, hidden)
        self.attn_backend.init_forward_metadata(batch)
        logits, hidden = self.model(batch, self.attn_backend)
        return LogitsOutput(logits, hidden)

    def _write_req_to_token(self, batch: ForwardBatch) -> None:
        """``req_to_token[row_b, prefix_b + i] = out_cache_loc`` for every new token i of every
        request b, on the device (no host sync): the scheduler allocates slots on the host and
        ships them once, in ``out_cache_loc``. Columns follow KV order, not RoPE positions
        (tree verify places nodes at prefix + depth)."""
        if batch.num_tokens == 0:
            return
        if batch.num_tokens == batch.batch_size:  # one token per request (decode)
            rows, cols = batch.req_pool_indices, batch.extend_prefix_lens
        else:
            t = batch.num_tokens
            b = torch.repeat_interleave(torch.arange(batch.batch_size, device=self.device),
                                        batch.extend_seq_lens, output_size=t)
            starts = torch.cumsum(batch.extend_seq_lens, 0) - batch.extend_seq_lens
            rows = batch.req_pool_indices[b]
            cols = torch.arange(t, device=self.device) - starts[b] + batch.extend_prefix_lens[b]
        self.req_to_token_pool.req_to_token[rows, cols] = batch.out_cache_loc.to(torch.int32)
