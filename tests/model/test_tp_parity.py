"""Tensor parallelism on CPU (gloo): greedy tokens at tp=2 and tp=4 equal tp=1 in float32.

Each tp size spawns its ranks once (imports dominate on a 2-core CI box) and every rank runs the
real per-rank path (``create_store`` -> ``init_parallel_state`` -> ``start_scheduler``, which
shares the sampler seed) for every model in turn, stepping its scheduler in lockstep. Models:
tiny Llama (4 q / 2 kv heads: KV replicated at tp=4), tiny Qwen3 (1 kv head: replicated at
tp>1, qk-norm, head_dim 32) and stories260K (8 q / 4 kv heads, tied embeddings). An unseeded
random-sampling request checks that every rank draws the same tokens.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from engine.config import EngineArgs
from engine.distributed.parallel_state import ParallelState
from tests.conftest import STORIES
from tests.tp_engine import generate_on_rank, run_tp_ranks

PROMPTS = [[1, 17, 33, 5, 99, 64, 12, 7, 88, 3], [1, 40, 41, 42]]
NEW_TOKENS = 12


def _args(model: str) -> EngineArgs:
    return EngineArgs(model_path=model, tokenizer_path=None if model == STORIES else STORIES,
                      dtype="float32", device="cpu", max_total_tokens=1024,
                      max_running_requests=4, skip_warmup=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.model.tiny_models import make_tiny  # imports transformers: keep it out of ranks

    folder = str(tmp_path_factory.mktemp("tiny-tp"))
    return [make_tiny("llama", folder), make_tiny("qwen3", folder), STORIES]


@pytest.fixture(scope="module")
def tp1(models):
    return {m: generate_on_rank(_args(m), ParallelState(), PROMPTS, NEW_TOKENS) for m in models}


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_at_tp_match_tp1_on_cpu(tp, models, tp1):
    jobs = [(dataclasses.replace(_args(m), tp_size=tp), PROMPTS, NEW_TOKENS) for m in models]
    got = run_tp_ranks(jobs)
    for i, model in enumerate(models):
        name = os.path.basename(model)
        greedy0 = got[0][i][:len(PROMPTS)]
        assert greedy0 == tp1[model][:len(PROMPTS)], f"{name}: tp={tp} differs from tp=1"
        assert all(len(o) == NEW_TOKENS for o in greedy0)
        for rank in range(1, tp):  # lockstep: every rank has the same tokens, sampled ones too
            assert got[rank][i] == got[0][i], f"{name}: rank {rank} diverged"
