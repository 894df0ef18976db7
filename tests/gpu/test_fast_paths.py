"""GPU fast paths against their plain counterparts (bf16):

- the decoder stack with residual adds folded into flashinfer ``fused_add_rmsnorm`` against the
  plain add + RMSNorm layers;
- CUDA-graph decode (fast re-plan, one K/V scatter, packed input copy) against eager decode for
  page sizes 1 and 16, batch sizes that hit a bucket and that are padded, over many steps;
- the all-greedy sampling shortcut against the full sampler on real logits."""

import json

import pytest
import torch

import engine.models.llama as llama
from engine.runner.sampler import Sampler, SamplingBatchInfo, greedy_next_ids, plain_greedy
from engine.types import ForwardMode, Req, SamplingParams
from tests.gpu.helpers import Driver, dummy_runner, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
       "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8,
       "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 1024,
       "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def make_runner(path: str, page_size: int, graphs: bool, backend: str = "flashinfer"):
    return dummy_runner(path, page_size=page_size, attention_backend=backend,
                        disable_cuda_graph=not graphs, cuda_graph_max_bs=8,
                        max_total_tokens=8192)


def test_fused_add_rmsnorm_stack_matches_plain_layers(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    runner = make_runner(str(tmp_path), 1, graphs=False, backend="torch")
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 512, (40,), generator=g).tolist()

    def run():
        d = Driver(runner)
        out = d.step(ForwardMode.EXTEND, [(0, toks[:25]), (1, toks[25:])])
        runner.allocator.clear()
        return out

    fused = run()
    monkeypatch.setattr(llama, "fused_ok", lambda x: None)
    plain = run()
    assert torch.isfinite(fused).all()
    assert rel_err(fused, plain) < 1e-2, rel_err(fused, plain)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_decode_matches_eager_over_many_steps(tmp_path, page_size):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    drivers = [Driver(make_runner(str(tmp_path), page_size, graphs=gr)) for gr in (True, False)]
    assert drivers[0].r.graph_runner is not None and drivers[1].r.graph_runner is None
    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(3, 512, (n,), generator=g).tolist()

    lens = [5, 17, 33, 2, 40, 9, 16]
    prefill = [(i, toks(n)) for i, n in enumerate(lens)]
    for d in drivers:
        d.step(ForwardMode.EXTEND, prefill)
    # batch sizes 7 (padded to 8), 4 (a bucket), 3 (padded to 4), 1, then 7 again: the graph
    # buffers see shrinking and growing batches and page-boundary crossings (page 16)
    for active in ([0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3], [4, 5, 6], [2], list(range(7))):
        for _ in range(6):
            work = [(i, toks(1)) for i in active]
            got, ref = (d.step(ForwardMode.DECODE, work) for d in drivers)
            assert torch.isfinite(got).all()
            assert rel_err(got, ref) < 2e-2, (active, rel_err(got, ref))


def test_greedy_shortcut_equals_full_sampler_on_model_logits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    d = Driver(make_runner(str(tmp_path), 1, graphs=False))
    logits = d.step(ForwardMode.EXTEND, [(i, list(range(3 + i, 20 + 2 * i))) for i in range(5)])
    reqs = [Req(rid=str(i), origin_input_ids=[1], sampling_params=SamplingParams(temperature=0))
            for i in range(5)]
    assert plain_greedy(reqs)
    info = SamplingBatchInfo.from_reqs(reqs, 512, logits.device)
    assert greedy_next_ids(logits).tolist() == Sampler(0)(logits, info, reqs).next_token_ids.tolist()
