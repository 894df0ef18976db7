"""Time the Llama-3.1-8B decode matmuls (bf16, F.linear as the model calls them) at several
batch sizes and compare with the weight-read floor at the measured copy bandwidth: shows
whether cuBLAS picks a bandwidth-efficient kernel for each (M, N, K).

    python bench/gemm_shapes.py --batch-sizes 1 8 32 128
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}


def time_ms(fn, iters: int = 50) -> float:
    # CUDA graph of `iters` calls: no launch gaps; weights rotate through 4 copies (no L2 reuse)
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--bandwidth", type=float, default=4.28e12, help="copy B/s (read+write)")
    a = ap.parse_args()
    print("| matmul | N x K | " + " | ".join(f"M={m} us (% of floor)" for m in a.batch_sizes)
          + " |")
    print("|---|---|" + "---|" * len(a.batch_sizes))
    total = {m: 0.0 for m in a.batch_sizes}
    floor_total = {m: 0.0 for m in a.batch_sizes}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        cells = []
        for m in a.batch_sizes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = time_ms(lambda i: F.linear(x, ws[i % 4]))
            floor = (n * k + m * k + m * n) * 2 / a.bandwidth * 1e3
            mult = 32 if name != "lm_head" else 1
            total[m] += ms * mult
            floor_total[m] += floor * mult
            cells.append(f"{ms * 1e3:.1f} ({floor / ms * 100:.0f}%)")
        print(f"| {name} | {n} x {k} | " + " | ".join(cells) + " |")
        del ws
    print("| per step (32 layers + lm_head), ms | | " + " | ".join(
        f"{total[m]:.2f} (floor {floor_total[m]:.2f})" for m in a.batch_sizes) + " |")


if __name__ == "__main__":
    main()
