"""``CudaGraphRunner``: DECODE steps replayed from CUDA graphs, one per batch-size bucket.

A batch of ``raw`` requests runs on the smallest captured bucket ``bs >= raw``; the extra
``bs - raw`` rows are dummy requests: token 0 at position 0, KV written to the reserved scratch
slot 0, and a page table from the reserved all-zeros ``req_to_token`` row (kv_len 1, never 0:
flashinfer yields NaN for empty rows). Their outputs are cut off. Buckets follow SGLang's list
(shared/reference/sglang-facts.md section 5.1) and are captured largest first into one shared
memory pool. Before each replay the bucket's flashinfer decode wrapper is re-planned (host work
+ async H2D copies into its fixed buffers); ``plan()`` itself cannot be captured.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from engine.runner.forward_batch import ForwardBatch
from engine.types import ForwardMode

logger = logging.getLogger(__name__)


def batch_size_buckets(max_bs: int) -> list[int]:
    """[1, 2, 4, 8, 12, 16, 24, ..., 256 step 8, 272, ... step 16] cut at ``max_bs`` (which is
    always included)."""
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + \
        list(range(512, max_bs + 1, 32))
    out = [b for b in sizes if b <= max_bs]
    if not out or out[-1] != max_bs:
        out.append(max_bs)
    return out


def _consecutive_rows(fields: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """A [len(fields), n] view when the 1-D tensors ``fields`` (same dtype, length n, contiguous)
    lie back to back in one storage, else None."""
    first = fields[0]
    n = first.shape[0]
    step = n * first.element_size()
    for i, t in enumerate(fields):
        if (t.dim() != 1 or t.shape[0] != n or t.dtype != first.dtype or t.stride(0) != 1
                or t.device != first.device
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.data_ptr() != first.data_ptr() + i * step):
            return None
    return first.as_strided((len(fields), n), (n, 1))


class CudaGraphRunner:
    """Captures the model's DECODE forward for each bucket at construction (call it before the
    engine reports ready: capture takes seconds). ``runner``: a ModelRunner with a
    FlashInferBackend; ``padding_row``: a reserved all-zeros ``req_to_token`` row."""

    def __init__(self, runner, max_bs: int, padding_row: int):
        self.model, self.backend = runner.model, runner.attn_backend
        self.device = runner.device
        self.padding_row = padding_row
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        ps = runner.page_size
        max_pages = min(self.max_bs * -(-runner.context_len // ps),
                        runner.allocator.num_pages + 1 + self.max_bs)
        self.backend.init_cuda_graph_state(self.max_bs, max_pages)

        def buf(fill: int) -> torch.Tensor:
            return torch.full((self.max_bs,), fill, dtype=torch.int64, device=self.device)

        # the five per-step inputs are rows of one tensor (the order of build_forward_batch's
        # packed fields), so a step's inputs and the dummy-row fill are one copy each
        fills = (0, 0, 0, padding_row, 1)  # input_ids, positions, out_cache_loc, rows, seq_lens
        self.static_inputs = torch.tensor(fills, dtype=torch.int64,
                                          device=self.device)[:, None].repeat(1, self.max_bs)
        self.pad_inputs = self.static_inputs.clone()
        (self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices,
         self.seq_lens) = self.static_inputs.unbind(0)
        self.zeros, self.ones = buf(0), buf(1)
        self.logits_indices = torch.arange(self.max_bs, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture_seconds = self._capture()

    def _static_batch(self, bs: int, seq_lens_cpu: list[int], rows_cpu: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            extend_prefix_lens=self.zeros[:bs], extend_seq_lens=self.ones[:bs],
            logits_indices=self.logits_indices[:bs], seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens_cpu=[s - 1 for s in seq_lens_cpu], extend_seq_lens_cpu=[1] * bs,
            req_pool_indices_cpu=rows_cpu)

    @torch.inference_mode()
    def _capture(self) -> float:
        logger.info("Capture cuda graph begin. This can take up to several minutes. bs %s",
                    self.buckets)
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        phases = []  # per bucket: (bs, plan + warm-up seconds, capture seconds)
        for bs in reversed(self.buckets):
            t = time.perf_counter()
            batch = self._static_batch(bs, [1] * bs, [self.padding_row] * bs)
            self.backend.init_forward_metadata_cuda_graph(batch)
            for _ in range(2):  # warm up: lazy inits, cuBLAS handles/workspaces
                self.model(batch, self.backend)
            torch.cuda.synchronize(self.device)
            t_warm = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(batch, self.backend)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs], self.outputs[bs] = graph, out
            phases.append((bs, t_warm - t, time.perf_counter() - t_warm))
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**30
        slow = sorted(phases, key=lambda p: -(p[1] + p[2]))[:3]
        logger.info("Capture cuda graph end. Time elapsed: %.2f s (warm-up %.2f s, capture "
                    "%.2f s; slowest bs: %s). mem usage=%.2f GB", elapsed,
                    sum(p[1] for p in phases), sum(p[2] for p in phases),
                    ", ".join(f"{b} {w:.2f}+{c:.2f} s" for b, w, c in slow), used)
        return elapsed

    def can_run(self, batch: ForwardBatch) -> bool:
        """DECODE, no mask, at most ``max_bs`` requests, one logits row per request."""
        return (batch.mode == ForwardMode.DECODE and batch.custom_mask is None
                and batch.batch_size <= self.max_bs
                and batch.logits_indices.shape[0] == batch.batch_size
                and batch.num_tokens == batch.batch_size)

    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [raw, vocab] float32, hidden [raw, hidden]): views of the graph's
        static outputs, valid until the next replay."""
        raw = batch.batch_size
        bs = self.buckets[bisect.bisect_left(self.buckets, raw)]
        fields = (batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices,
                  batch.seq_lens)
        packed = _consecutive_rows(fields)
        if packed is not None:  # build_forward_batch's layout: one copy
            self.static_inputs[:, :raw].copy_(packed)
        else:
            for dst, src in zip(self.static_inputs, fields):
                dst[:raw].copy_(src)
        if bs > raw:  # dummy rows: an earlier, larger batch may have left real values here
            self.static_inputs[:, raw:bs].copy_(self.pad_inputs[:, raw:bs])
        pad = bs - raw
        static = self._static_batch(bs, batch.seq_lens_cpu + [1] * pad,
                                    batch.req_pool_indices_cpu + [self.padding_row] * pad)
        self.backend.init_forward_metadata_cuda_graph(static)
        self.graphs[bs].replay()
        logits, hidden = self.outputs[bs]
        return logits[:raw], hidden[:raw]
