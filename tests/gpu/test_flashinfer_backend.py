"""FlashInfer backend against the torch backend (the oracle) on the same GPU batches: extend
from scratch, extend on top of a cached prefix, decode, mixed lengths, page sizes 1 and 16,
head_dim 64 and a padded head_dim 8, and a custom (tree) mask. bf16 both sides."""

import json

import pytest
import torch

from engine.runner.model_runner import ModelRunner
from engine.types import ForwardMode
from tests.gpu.helpers import Driver, dummy_runner, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_config(head_dim: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": head_dim, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def make_runner(path: str, backend: str, page_size: int) -> ModelRunner:
    return dummy_runner(path, page_size=page_size, attention_backend=backend,
                        disable_cuda_graph=True, max_total_tokens=4096)


@pytest.mark.parametrize("head_dim,page_size", [(64, 1), (64, 16), (8, 1)])
def test_flashinfer_logits_match_torch_backend(tmp_path, head_dim, page_size):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(head_dim)))
    runners = [make_runner(str(tmp_path), b, page_size) for b in ("torch", "flashinfer")]
    drivers = [Driver(r, every_token=True) for r in runners]
    g = torch.Generator().manual_seed(0)

    def toks(n):
        return torch.randint(3, 512, (n,), generator=g).tolist()

    steps = [(ForwardMode.EXTEND, [(0, toks(5)), (1, toks(37)), (2, toks(130))]),
             (ForwardMode.EXTEND, [(0, toks(20)), (1, toks(1)), (3, toks(9))]),  # on a prefix
             (ForwardMode.DECODE, [(0, toks(1)), (1, toks(1)), (2, toks(1)), (3, toks(1))])]
    steps += [(ForwardMode.DECODE, [(i, toks(1)) for i in range(4)]) for _ in range(5)]
    for mode, work in steps:
        ref, got = (d.step(mode, work) for d in drivers)
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) < 2e-2, (mode, rel_err(got, ref))


def test_custom_mask_prefill_matches_torch_backend(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(64)))
    runners = [make_runner(str(tmp_path), b, 1) for b in ("torch", "flashinfer")]
    drivers = [Driver(r, every_token=True) for r in runners]
    prompts = [(0, list(range(10, 30))), (1, list(range(40, 47)))]
    for d in drivers:
        d.step(ForwardMode.EXTEND, prompts)
    g = torch.Generator().manual_seed(1)
    work, masks = [], []
    for rid, prefix in ((0, 20), (1, 7)):
        n = 4  # a 4-node tree: root, two children of the root, one grandchild
        parent = [-1, 0, 0, 1]
        m = torch.zeros(n, prefix + n, dtype=torch.bool)
        m[:, :prefix] = True
        for i in range(n):
            j = i
            while j >= 0:
                m[i, prefix + j] = True
                j = parent[j]
        work.append((rid, torch.randint(3, 512, (n,), generator=g).tolist()))
        masks.append(m.cuda())
    ref, got = (d.step(ForwardMode.TARGET_VERIFY, work, custom_mask=masks) for d in drivers)
    assert rel_err(got, ref) < 2e-2
