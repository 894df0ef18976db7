"""Eyrie's engine against transformers in float32 on CPU: greedy tokens and logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.engine import Engine
from tests.conftest import STORIES_GOLDEN
from tests.model.tiny_models import make_tiny

PROMPT = [1, 17, 33, 5, 99, 64, 12, 7, 88, 3]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_on_tiny_models(kind, tiny_dir):
    path = make_tiny(kind, tiny_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False,
                      min_new_tokens=32)[0, len(PROMPT):].tolist()
    eng = Engine(model_path=path, tokenizer_path="tests/fixtures/stories260K")
    out = eng.generate(input_ids=PROMPT,
                       sampling_params={"temperature": 0, "max_new_tokens": 32,
                                        "ignore_eos": True})
    assert out["output_ids"] == ref


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers_at_prefill_and_decode(kind, tiny_dir):
    path = make_tiny(kind, tiny_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    eng = Engine(model_path=path, tokenizer_path="tests/fixtures/stories260K")
    out = eng.generate(input_ids=PROMPT, return_logprob=True, top_logprobs_num=128,
                       sampling_params={"temperature": 0, "max_new_tokens": 9,
                                        "ignore_eos": True})
    ids = PROMPT + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    # top-128 of a 128-token vocabulary is the whole next-token distribution
    for step, top in enumerate(out["meta_info"]["output_top_logprobs"]):
        ours = torch.zeros(128)
        for lp, tid in top:
            ours[tid] = lp
        expected = ref[len(PROMPT) - 1 + step]
        assert (ours - expected).abs().max().item() < 1e-4, f"step {step}"


def test_logits_match_transformers_raw(tiny_dir):
    """The runner's raw logits (not log-softmax) equal transformers' within 1e-4."""
    path = make_tiny("qwen3", tiny_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    eng = Engine(model_path=path, tokenizer_path="tests/fixtures/stories260K")
    from engine.runner.forward_batch import build_forward_batch
    from engine.types import ForwardMode
    runner = eng.scheduler.runner
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc(0, 0, len(PROMPT))
    runner.req_to_token_pool.req_to_token[row, :len(PROMPT)] = torch.tensor(slots)
    n = len(PROMPT)
    batch = build_forward_batch(ForwardMode.EXTEND, PROMPT, list(range(n)), slots, [row], [0],
                                [n], list(range(n)), runner.device)
    ours = runner.forward(batch).next_token_logits
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_stories260k_golden_greedy(stories_path):
    eng = Engine(model_path=stories_path)
    out = eng.generate("Once upon a time", {"temperature": 0, "max_new_tokens": 57})
    assert out["text"] == STORIES_GOLDEN
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 57}
