"""API-process pieces without a running server: body parsing, stop-string hold-back, flags,
metrics registries."""

from __future__ import annotations

import pytest

from engine.types import InvalidRequestError
from server.args import parse_args
from server.metrics import ServerMetrics
from server.schemas import ChatCompletionRequest, GenerateRequest, parse_body


def test_parse_body_names_the_bad_field():
    with pytest.raises(InvalidRequestError) as e:
        parse_body(GenerateRequest, b'{"text": 5}')
    assert e.value.field == "text"
    with pytest.raises(InvalidRequestError) as e:
        parse_body(GenerateRequest, b'{"text": "a",')
    assert e.value.field == "body" and "JSON" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": 3}]}')
    assert str(e.value).startswith("messages.0.content")
    body = parse_body(GenerateRequest, b'{"input_ids": [[1, 2], [3]], "unknown": 1}')
    assert body.input_ids == [[1, 2], [3]]


def test_flags_map_onto_engine_args():
    args = parse_args(["--model-path", "m", "--port", "1234", "--context-length", "256",
                       "--disable-radix-cache", "--health-check-timeout", "3",
                       "--debug-startup-delay", "2", "--served-model-name", "tiny"])
    assert args.engine.model_path == "m" and args.engine.context_length == 256
    assert args.engine.disable_radix_cache and args.engine.debug_startup_delay == 2.0
    assert args.port == 1234 and args.health_check_timeout == 3.0 and args.host == "127.0.0.1"
    assert args.model_name == "tiny" and args.to_info_dict()["context_length"] == 256


def test_each_server_has_its_own_metrics_registry():
    a, b = ServerMetrics("m"), ServerMetrics("m")
    a.observe_finished(5, 7, 0, 0.1, aborted=False)
    assert b"sglang:num_requests_total{model_name=\"m\"} 1.0" in a.render()
    assert b"sglang:num_requests_total{model_name=\"m\"} 1.0" not in b.render()


def test_logprob_token_text_keeps_sentencepiece_leading_space():
    from engine.tokenizer import load_tokenizer
    from server.openai_format import completion_logprobs
    from tests.conftest import STORIES
    tok = load_tokenizer(STORIES)
    ids = tok.encode("a time", add_special_tokens=False)  # "▁a", "▁time"
    lp = completion_logprobs(tok, [(-0.5, t) for t in ids], [], 0)
    assert lp["tokens"] == [" a", " time"] and lp["text_offset"] == [0, 2]
