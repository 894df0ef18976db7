"""Tensor parallelism on 2 GPUs (NCCL): greedy tokens of tp=2 equal tp=1 on stories260K.

float32 with the torch attention backend is exact; the GPU default (bf16, default backend)
must agree on the first tokens (stories260K's top logits are far from ties there). Runs the
real process tree: ``run_engine`` (rank 0) spawns rank 1, both join NCCL + a gloo CPU group.

    python -m pytest -q tests/gpu/test_tp_gpu.py
"""

import pytest
import torch

from engine.config import EngineArgs
from engine.distributed.parallel_state import ParallelState
from tests.conftest import STORIES
from tests.tp_engine import EngineProcess, generate_on_rank

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

PROMPTS = [[1, 403, 407, 261], [1, 5, 6, 7, 8, 9, 10]]


@pytest.mark.parametrize("dtype,backend,compare", [
    ("float32", "torch", 24),
    # Known failure (H200 x2 run, 2026-11-29): bf16 flashinfer + CUDA graphs at tp=2 gives other
    # tokens than tp=1 from the first token of prompt 1; float32/torch at tp=2 is exact.
    pytest.param("auto", None, 8, marks=pytest.mark.xfail(
        strict=True, reason="tp=2 bf16 flashinfer path diverges from tp=1 (open bug)"))])
def test_greedy_tokens_tp2_match_tp1_on_gpu(dtype, backend, compare):
    args = EngineArgs(model_path=STORIES, dtype=dtype, device="cuda", attention_backend=backend,
                      max_total_tokens=4096, max_running_requests=8, skip_warmup=True)
    ref = generate_on_rank(args, ParallelState(), PROMPTS, 24)[:len(PROMPTS)]
    with EngineProcess(EngineArgs(**{**args.__dict__, "tp_size": 2})) as eng:
        got = eng.generate(PROMPTS, max_new_tokens=24)
        assert eng.control("flush_cache").success
    assert [o[:compare] for o in got] == [o[:compare] for o in ref]
