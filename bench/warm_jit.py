"""Compile (JIT) every flashinfer kernel the engine uses for one head_dim, on a tiny dummy model:
paged prefill, tensor-core and CUDA-core decode (eager and CUDA-graph), RMSNorm, SiLU-and-mul,
RoPE.

    python bench/warm_jit.py 128 &  python bench/warm_jit.py 64 &  wait

Kernels land in ~/.cache/flashinfer and are reused by later processes on the same machine; run
several head_dims in parallel (flashinfer's file locks serialise builds of the same module).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from engine.config import EngineArgs, ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.runner.forward_batch import build_forward_batch
from engine.runner.model_runner import ModelRunner
from engine.types import ForwardMode


def warm(head_dim: int) -> float:
    t0 = time.perf_counter()
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 512,
           "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": head_dim, "max_position_embeddings": 256}
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump(cfg, f)
        args = EngineArgs(model_path=d, device="cuda", load_format="dummy", max_total_tokens=512,
                          max_running_requests=2, cuda_graph_max_bs=2)
        runner = ModelRunner(args, d, ModelConfig.from_path(d), ParallelState())
        ext = build_forward_batch(ForwardMode.EXTEND, [5, 6, 7], [0, 1, 2], [1, 2, 3], [0], [0],
                                  [3], [2], runner.device)
        runner.forward(ext)
        dec = build_forward_batch(ForwardMode.DECODE, [8], [3], [4], [0], [3], [1], [0],
                                  runner.device)
        runner.forward(dec)
        runner.graph_runner.replay(dec)  # through the graph as well
        torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    for hd in sys.argv[1:] or ["128"]:
        for mode in ("1", "0"):  # tensor-core decode, then the CUDA-core decode kernel
            os.environ["EYRIE_DECODE_TENSOR_CORES"] = mode
            print(f"head_dim {hd}, decode tensor cores {mode}: kernels ready in "
                  f"{warm(int(hd)):.1f} s", flush=True)
