"""The README's serve command (``python -m server``: default SmolLM2-135M-Instruct GGUF)
driven by the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest

QUESTION = [{"role": "user",
             "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server(launch):
    return launch([])  # no --model-path: the default SmolLM2 GGUF


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)


def test_chat_completion_capital_of_france(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    assert getattr(r, "metadata", None) == {"weight_version": "default"}


def test_streamed_chat_equals_non_streamed_with_usage(client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == "The capital of France is Paris."
    assert finish == "stop" and usage is not None and usage.completion_tokens > 0


def test_completions_n_stop_max_tokens_and_logprobs(client):
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="The capital of France is", n=2,
                                  max_tokens=6, temperature=0.8, seed=1, logprobs=2)
    assert len(r.choices) == 2 and r.usage.completion_tokens <= 12
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in r.choices)
    r = client.completions.create(model=model, prompt="The capital of France is",
                                  max_tokens=6, temperature=0, stop=["."])
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, top_p=0)
    assert "top_p" in str(e.value)
