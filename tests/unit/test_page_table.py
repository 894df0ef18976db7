"""The flashinfer backend's page table (built on the device without a host sync) against a
plain Python construction, and the CUDA-graph bucket list."""

import random

import pytest
import torch

from engine.attention.flashinfer_backend import (host_page_meta, kv_head_dim, page_table_indices,
                                                use_decode_tensor_cores)
from engine.runner.cuda_graph import batch_size_buckets


def test_page_table_matches_python_construction():
    rng = random.Random(0)
    for page_size in (1, 4, 16):
        rows, ctx = 9, 64
        r2t = torch.randint(0, 1000, (rows, ctx), dtype=torch.int32)
        r2t = r2t - r2t % page_size + torch.arange(ctx, dtype=torch.int32) % page_size
        bs = 5
        req_rows = rng.sample(range(rows), bs)
        seq = [rng.randint(1, ctx) for _ in range(bs)]
        indptr, last = host_page_meta(seq, page_size)
        got = page_table_indices(r2t, torch.tensor(req_rows), torch.tensor(seq),
                                 int(indptr[-1]), page_size)
        want, want_last = [], []
        for r, s in zip(req_rows, seq):
            n = -(-s // page_size)
            want += [int(r2t[r, j * page_size]) // page_size for j in range(n)]
            want_last.append(s - (n - 1) * page_size)
        assert got.dtype == torch.int32 and got.tolist() == want
        assert last.tolist() == want_last and 1 <= min(want_last) and max(want_last) <= page_size
        assert indptr.dtype == torch.int32 and int(indptr[-1]) == len(want)


def test_kernel_head_dim_pads_to_supported_width():
    assert [kv_head_dim(d) for d in (8, 64, 96, 128, 256)] == [64, 64, 128, 128, 256]


def test_buckets_cut_at_max_and_include_it():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 12, 16, 20]
    b = batch_size_buckets(256)
    assert b[:6] == [1, 2, 4, 8, 12, 16] and b[-1] == 256 and len(b) == 36


@pytest.mark.parametrize("heads,kv_heads,mode,expected", [
    (32, 8, "auto", True),    # Llama-3.1-8B, group 4: tensor cores (SGLang's rule)
    (8, 4, "auto", False),    # stories260K, group 2: CUDA-core decode kernel
    (9, 3, "auto", False),    # SmolLM2-135M, group 3
    (40, 8, "auto", True),    # group 5: no CUDA-core kernel instantiated
    (8, 4, "1", True), (32, 8, "0", False)])
def test_decode_tensor_core_choice(heads, kv_heads, mode, expected):
    assert use_decode_tensor_cores(heads, kv_heads, mode) is expected


@pytest.mark.parametrize("heads,kv_heads,mode", [(40, 8, "0"), (8, 4, "yes")])
def test_decode_tensor_core_choice_rejects(heads, kv_heads, mode):
    with pytest.raises(ValueError):
        use_decode_tensor_cores(heads, kv_heads, mode)
