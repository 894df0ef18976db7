"""Shared pieces of the GPU tests: a ModelRunner on dummy weights and a ``Driver`` that feeds it
batches the way the scheduler does, a relative error, and greedy-divergence / near-tie checks."""

import torch

from engine.config import EngineArgs, ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.runner.forward_batch import build_forward_batch
from engine.runner.model_runner import ModelRunner

# largest reference top-2 logprob gap that counts as a near-tie (ARCHITECTURE.md invariant 2)
NEAR_TIE = 1e-2


def dummy_runner(path: str, **engine_args) -> ModelRunner:
    """A ModelRunner on CUDA with dummy weights for the ``config.json`` in ``path`` and 8
    request rows (``Driver`` uses request ids as rows); ``engine_args`` go to EngineArgs."""
    args = EngineArgs(model_path=path, device="cuda", load_format="dummy",
                      max_running_requests=8, **engine_args)
    return ModelRunner(args, path, ModelConfig.from_path(path), ParallelState())


class Driver:
    """Allocates KV like the scheduler and builds ForwardBatches for one runner; request id =
    ``req_to_token`` row (``runner.forward`` writes the row). ``step`` returns logits for the
    last token of each request, or with ``every_token`` for every new token (CUDA graphs only
    replay the former)."""

    def __init__(self, runner: ModelRunner, every_token: bool = False):
        self.r = runner
        self.every_token = every_token
        self.slots: dict[int, list[int]] = {}

    def step(self, mode, work: list[tuple[int, list[int]]], custom_mask=None) -> torch.Tensor:
        ids, pos, locs, rows, prefix, ext, logit_rows = [], [], [], [], [], [], []
        for rid, toks in work:
            have = self.slots.setdefault(rid, [])
            new = self.r.allocator.alloc(len(have), have[-1] if have else 0, len(toks))
            prefix.append(len(have))
            ids += toks
            pos += range(len(have), len(have) + len(toks))
            locs += new
            have += new
            rows.append(rid)
            ext.append(len(toks))
            if self.every_token:
                logit_rows += range(len(ids) - len(toks), len(ids))
            else:
                logit_rows.append(len(ids) - 1)
        batch = build_forward_batch(mode, ids, pos, locs, rows, prefix, ext, logit_rows,
                                    self.r.device, custom_mask)
        return self.r.forward(batch).next_token_logits.clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms) in float32."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def first_divergence(a: list[int], b: list[int], *, strict_length: bool) -> int | None:
    """First index where ``a`` and ``b`` differ, or None. With ``strict_length`` a list that is
    a proper prefix of the other differs at ``min(len(a), len(b))``; without, it does not."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if not strict_length or len(a) == len(b) else min(len(a), len(b))


def near_tie_pick(top: list, tok: int, tol: float) -> bool:
    """Whether ``tok`` is among the reference's ``top`` candidates (``(logprob, token id, ...)``,
    best first) and its logprob is less than ``tol`` below the best one."""
    lp = {t: v for v, t, *_ in top}
    return tok in lp and top[0][0] - lp[tok] < tol
