"""FlashInfer paged attention (GPU default): decode, extend over a cached prefix, custom masks,
and the CUDA-graph hooks used by ``CudaGraphRunner``.

KV layout: ``KVCache`` keeps per layer K and V as [num_slots, H_kv, D] with num_slots =
(num_pages + 1) * page_size; viewed as flashinfer's NHD paged cache [num_pages + 1, page_size,
H_kv, D] at no cost. A request's page table is ``req_to_token[row, 0:seq_len:page_size] //
page_size``, gathered on the GPU (no host sync); indptr and last_page_len come from the
ForwardBatch's ``*_cpu`` lists, so ``plan()`` needs no device-to-host copy.

Kernels (flashinfer 0.6.18; shared/reference/flashinfer-facts.md sections 1-4, 8):
- DECODE (one query per request, no mask): ``BatchDecodeWithPagedKVCacheWrapper``, with tensor
  cores (the fa2 prefill kernels; any GQA group size) or the CUDA-core decode kernel (GQA group
  sizes 1, 2, 3, 4, 6, 8 only). ``EYRIE_DECODE_TENSOR_CORES`` = ``auto`` (default: tensor cores
  when the group size is at least ``TENSOR_CORE_MIN_GROUP`` or has no CUDA-core kernel), ``1``
  or ``0``. CUDA-graph re-plans go through ``flashinfer.fast_decode_plan`` (section 2).
- EXTEND: K/V of the new tokens are written to their slots first, then one
  ``BatchPrefillWithPagedKVCacheWrapper`` call over prefix + new tokens with ``causal=True``
  (bottom-right aligned, so new tokens see the prefix and earlier new tokens), or with the
  batch's bool ``custom_mask`` (tree verify). Pinned to ``backend="fa2"``: one JIT module per
  head_dim serves decode, prefill and masks (fa3 rejects custom masks).
- head_dim outside the kernels' set {64, 128, 256} (e.g. stories260K's 8) is zero-padded to the
  next one: the KV cache is allocated with the padded width (``kv_head_dim``), q/k/v are padded,
  scores are unchanged (zeros add nothing) and the output is cut back; sm_scale stays
  1/sqrt(model head_dim).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.runner.forward_batch import ForwardBatch

KERNEL_HEAD_DIMS = (64, 128, 256)
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 6, 8)  # DISPATCH_GQA_GROUP_SIZE of the decode kernel
TENSOR_CORE_MIN_GROUP = 4  # SGLang's rule for bf16/fp16 KV (flashinfer-facts.md section 2)
WORKSPACE_BYTES = 256 * 2**20  # split-KV partials; shared by every wrapper (one stream)


def use_decode_tensor_cores(num_qo_heads: int, num_kv_heads: int, mode: str = "auto") -> bool:
    """Whether DECODE runs on the tensor-core (fa2 prefill) kernels. ``mode``: "auto", "1" or
    "0" (the value of ``EYRIE_DECODE_TENSOR_CORES``). Raises ValueError for another mode, or
    for "0" with a group size the CUDA-core kernel does not instantiate."""
    group = num_qo_heads // num_kv_heads
    if mode == "auto":
        return group >= TENSOR_CORE_MIN_GROUP or group not in CUDA_CORE_GROUP_SIZES
    if mode not in ("0", "1"):
        raise ValueError(f"EYRIE_DECODE_TENSOR_CORES must be auto, 0 or 1, got {mode!r}")
    if mode == "0" and group not in CUDA_CORE_GROUP_SIZES:
        raise ValueError(f"GQA group size {group} needs tensor-core decode")
    return mode == "1"


def kv_head_dim(head_dim: int) -> int:
    """The head width the kernels run at (and the KV cache is allocated with)."""
    for d in KERNEL_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"flashinfer backend: head_dim {head_dim} > 256 is not supported")


def page_table_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, total_pages: int, page_size: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Flattened page ids of a batch, on the device of ``req_to_token``, without a host sync.

    ``req_pool_indices`` / ``seq_lens`` [B] int64 (device); ``total_pages`` = sum of
    ceil(seq_len / page_size) (known on the host). Returns [total_pages] int32: for request b,
    ``req_to_token[row_b, j * page_size] // page_size`` for j < ceil(seq_len_b / page_size).
    ``out``: optional int32 [total_pages] tensor to write into (returned).
    """
    pages = (seq_lens + page_size - 1) // page_size
    ends = torch.cumsum(pages, 0)
    i = torch.arange(total_pages, device=seq_lens.device)
    b = torch.searchsorted(ends, i, right=True)
    col = (i - (ends[b] - pages[b])) * page_size
    slots = req_to_token[req_pool_indices[b], col]
    if page_size > 1:
        slots = slots // page_size
    if out is None:
        return slots.to(torch.int32)
    return out.copy_(slots)


def kv_pair_view(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k, v [T, H, D] -> a [T, 2, H, D] view over both when v directly follows k in memory with
    the same strides (the k and v column blocks of the fused qkv projection output), else None."""
    if k.dim() != 3 or v.shape != k.shape or v.stride() != k.stride() or v.dtype != k.dtype:
        return None
    t, h, d = k.shape
    if k.stride(2) != 1 or k.stride(1) != d:
        return None
    if v.data_ptr() != k.data_ptr() + h * d * k.element_size():
        return None
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    return k.as_strided((t, 2, h, d), (k.stride(0), h * d, d, 1))


def host_page_meta(seq_lens: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [B+1], last_page_len [B]) as CPU int32 tensors from host seq lens."""
    pages = [-(-s // page_size) for s in seq_lens]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    last = [s - (n - 1) * page_size for s, n in zip(seq_lens, pages)]
    return (torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32))


class FlashInferBackend:
    """``runner``: a ModelRunner (uses ``kv_cache``, ``req_to_token_pool``, ``page_size``,
    ``dtype``, ``device``, ``model_config`` and the first layer's head counts)."""

    def __init__(self, runner):
        import flashinfer
        self.fi = flashinfer
        attn0 = runner.model.model.layers[0].self_attn
        self.num_qo_heads, self.num_kv_heads = attn0.num_heads, attn0.num_kv_heads
        self.head_dim = runner.model_config.head_dim
        self.kernel_head_dim = kv_head_dim(self.head_dim)
        self.sm_scale = self.head_dim ** -0.5
        self.kv = runner.kv_cache
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.page_size = runner.page_size
        self.dtype, self.device = runner.dtype, runner.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.tensor_cores = use_decode_tensor_cores(
            self.num_qo_heads, self.num_kv_heads,
            os.environ.get("EYRIE_DECODE_TENSOR_CORES", "auto"))
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        self.mask_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        self.graph_wrappers: dict = {}  # batch size -> graph-mode decode wrapper
        self._cg_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._active = None  # the wrapper planned for the current step

    # ------------------------------------------------------------------ planning
    def _common(self) -> dict:
        return dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.sm_scale)

    def _plan_decode(self, wrapper, batch: ForwardBatch) -> None:
        indptr, last = host_page_meta(batch.seq_lens_cpu, self.page_size)
        indices = page_table_indices(self.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                     int(indptr[-1]), self.page_size)
        wrapper.plan(indptr, indices, last, self.num_qo_heads, self.num_kv_heads,
                     self.kernel_head_dim, self.page_size, **self._common())
        self._active = wrapper

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan the step once (all layers reuse it). Host work + small async H2D copies only."""
        if batch.custom_mask is None and max(batch.extend_seq_lens_cpu) == 1:
            self._plan_decode(self.decode_wrapper, batch)
            return
        indptr, last = host_page_meta(batch.seq_lens_cpu, self.page_size)
        indices = page_table_indices(self.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                     int(indptr[-1]), self.page_size)
        qo = [0]
        for n in batch.extend_seq_lens_cpu:
            qo.append(qo[-1] + n)
        qo_indptr = torch.tensor(qo, dtype=torch.int32)
        if batch.custom_mask is None:
            wrapper, mask = self.prefill_wrapper, None
        else:  # row-major [ext, seq] blocks flattened in batch order; True = attend
            wrapper = self.mask_wrapper
            mask = torch.cat([m.to(self.device, torch.bool).reshape(-1)
                              for m in batch.custom_mask])
        wrapper.plan(qo_indptr, indptr, indices, last, self.num_qo_heads, self.num_kv_heads,
                     self.kernel_head_dim, self.page_size, custom_mask=mask,
                     causal=mask is None, **self._common())
        self._active = wrapper

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_pages: int) -> None:
        """Fixed int32 buffers shared (as slices) by the per-batch-size graph wrappers, and a
        pinned host staging buffer for the fast re-plan (indptr | last_page_len | kv_lens)."""
        self._cg_bufs = (torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                         torch.zeros(max_num_pages, dtype=torch.int32, device=self.device),
                         torch.ones(max_bs, dtype=torch.int32, device=self.device))
        self._cg_host = torch.zeros(3 * max_bs + 1, dtype=torch.int32, pin_memory=True)
        self._cg_host_free = torch.cuda.Event()  # the staging buffer's last H2D copy is done
        self._cg_host_free.record()
        self._ones_host = torch.ones(max_bs, dtype=torch.int32)  # last_page_len at page_size 1

    def init_forward_metadata_cuda_graph(self, batch: ForwardBatch) -> None:
        """Plan a (padded) DECODE batch on the graph wrapper of its batch size, creating the
        wrapper at capture time. Call before capture and before every replay."""
        bs = batch.batch_size
        wrapper = self.graph_wrappers.get(bs)
        if wrapper is None:
            indptr, indices, last = self._cg_bufs
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=indptr[:bs + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:bs])
            self.graph_wrappers[bs] = wrapper
            self._plan_decode(wrapper, batch)  # full plan once: resolves and caches the module
            return
        self._fast_plan_graph(wrapper, batch)

    def _fast_plan_graph(self, wrapper, batch: ForwardBatch) -> None:
        """Re-plan a graph wrapper already planned once (same batch size, dtypes, heads) with
        ``flashinfer.fast_decode_plan``, which in graph mode leaves the wrapper's device buffers
        alone: indptr (and last_page_len when page_size > 1) go up with one async copy each
        from a pinned buffer, page ids are gathered on the device straight into the indices
        buffer, and the kernel's scheduler gets the host indptr (no device-to-host copy)."""
        bs, ps = batch.batch_size, self.page_size
        seq = batch.seq_lens_cpu
        if ps == 1:
            pages, last = seq, None
        else:
            pages = [-(-s // ps) for s in seq]
            last = [s - (n - 1) * ps for s, n in zip(seq, pages)]
        indptr = [0]
        for n in pages:
            indptr.append(indptr[-1] + n)
        total = indptr[-1]
        indptr_d, indices_d, last_d = self._cg_bufs
        if total > indices_d.shape[0]:
            raise ValueError(f"CUDA-graph page table overflow: {total} > {indices_d.shape[0]}")
        self._cg_host_free.synchronize()  # the previous step's copies have read the buffer
        host = self._cg_host
        host[:bs + 1] = torch.tensor(indptr, dtype=torch.int32)
        indptr_h = host[:bs + 1]
        indptr_d[:bs + 1].copy_(indptr_h, non_blocking=True)
        if last is None:
            last_h = self._ones_host[:bs]
        else:
            last_h = host[bs + 1:2 * bs + 1]
            last_h.copy_(torch.tensor(last, dtype=torch.int32))
            last_d[:bs].copy_(last_h, non_blocking=True)
        self._cg_host_free.record()
        page_table_indices(self.req_to_token, batch.req_pool_indices, batch.seq_lens, total,
                           ps, out=indices_d[:total])
        # last_page_len is read on the host only (its length, and for tensor cores its values)
        self.fi.fast_decode_plan(
            wrapper, indptr_d[:bs + 1], indices_d[:total], last_h, self.num_qo_heads,
            self.num_kv_heads, self.kernel_head_dim, ps, global_override_indptr_cpu=indptr_h,
            **self._common())
        self._active = wrapper

    # ------------------------------------------------------------------ run
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (dtype of the cache) -> [T, Hq * D]. ``scale`` must be
        1/sqrt(D) (planned once per step as sm_scale)."""
        d, dk = self.head_dim, self.kernel_head_dim
        if dk != d:
            q, k, v = (F.pad(x, (0, dk - d)) for x in (q, k, v))
        k_buf, v_buf = self.kv.k_buffers[layer_id], self.kv.v_buffers[layer_id]
        pair = kv_pair_view(k, v)
        if pair is not None:  # one scatter writes K and V: kv[:, loc] = [k; v]
            self.kv.kv_buffers[layer_id][:, batch.out_cache_loc] = pair.transpose(0, 1)
        else:
            k_buf[batch.out_cache_loc] = k
            v_buf[batch.out_cache_loc] = v
        shape = (-1, self.page_size, self.num_kv_heads, dk)
        if q.stride(-1) != 1:  # the kernels take q's row and head strides (a view of qkv is
            q = q.contiguous()  # fine) but need a contiguous head_dim
        o = self._active.run(q, (k_buf.view(shape), v_buf.view(shape)))
        if dk != d:
            o = o[..., :d]
        return o.reshape(q.shape[0], self.num_qo_heads * d)
