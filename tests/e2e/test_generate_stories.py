"""``/generate`` on the stories260K fixture: golden greedy text, streaming equals non-streaming,
stop strings, concurrency, batches, logprobs, control routes and metrics."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "Once upon a time"
# tests/fixtures/stories260K/README.md: greedy continuation of "Once upon a time" (57 tokens)
GOLDEN = (", there was a little girl named Lily. She loved to play outside in the park. One day, "
          "she saw a big, red ball. She wanted to play with it, but it was too high.")
GOLDEN_TOKENS = 57
TIMEOUT = 120


def generate(url: str, **body) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def stream_generate(url: str, **body) -> list[dict]:
    """All SSE frames of a streaming ``/generate`` (the ``[DONE]`` frame must come last)."""
    frames, done = [], False
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            assert not done, "frame after [DONE]"
            if line == "data: [DONE]":
                done = True
            else:
                frames.append(json.loads(line[6:]))
    assert done
    return frames


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def test_greedy_generate_matches_golden(stories_server):
    out = generate(stories_server.url, text=PROMPT, sampling_params=greedy(GOLDEN_TOKENS))
    assert out["text"] == GOLDEN
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": GOLDEN_TOKENS}
    assert meta["completion_tokens"] == GOLDEN_TOKENS == len(out["output_ids"])
    assert meta["prompt_tokens"] == 5
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0 and meta["total_retractions"] == 0
    assert meta["id"] and "cached_tokens" in meta


def test_streamed_text_equals_non_streamed(stories_server):
    frames = stream_generate(stories_server.url, text=PROMPT,
                             sampling_params=greedy(GOLDEN_TOKENS))
    assert frames[-1]["text"] == GOLDEN
    assert frames[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # cumulative text and output_ids: each frame extends the previous one
    for prev, cur in zip(frames, frames[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
    assert len(frames[-1]["output_ids"]) == GOLDEN_TOKENS


@pytest.mark.parametrize("sampling", [
    {"stop": " girl"},
    {"stop": ["park", "Lily"]},
    {"max_new_tokens": 7},
    {"stop_token_ids": [286]},  # " was"
])
def test_stop_and_max_new_tokens_same_streamed_and_not(stories_server, sampling):
    sp = {**greedy(GOLDEN_TOKENS), **sampling}
    plain = generate(stories_server.url, text=PROMPT, sampling_params=sp)
    last = stream_generate(stories_server.url, text=PROMPT, sampling_params=sp)[-1]
    assert last["text"] == plain["text"]
    assert last["output_ids"] == plain["output_ids"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert GOLDEN.startswith(plain["text"])
    if "stop" in sampling:
        stops = sampling["stop"] if isinstance(sampling["stop"], list) else [sampling["stop"]]
        assert plain["meta_info"]["finish_reason"]["type"] == "stop"
        assert plain["meta_info"]["finish_reason"]["matched"] in stops
        assert not any(s in plain["text"] for s in stops)  # stop strings are trimmed


def test_32_concurrent_streams_match_greedy_alone(stories_server):
    prompts = [f"{PROMPT}{suffix}" for suffix in ["", " there", " a cat", " Tom"]] * 8
    alone = {p: generate(stories_server.url, text=p, sampling_params=greedy(40))["text"]
             for p in set(prompts)}
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(
            lambda p: stream_generate(stories_server.url, text=p,
                                      sampling_params=greedy(40))[-1]["text"], prompts))
    assert results == [alone[p] for p in prompts]


def test_batch_and_parallel_sampling(stories_server):
    out = generate(stories_server.url, text=[PROMPT, PROMPT + " there"], rid="batch",
                   sampling_params=greedy(10))
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["batch_0", "batch_1"]
    assert GOLDEN.startswith(out[0]["text"])
    ids = generate(stories_server.url, input_ids=[[1, 403, 407], [1, 403]],
                   sampling_params=[greedy(3), greedy(4)])
    assert [o["meta_info"]["completion_tokens"] for o in ids] == [3, 4]
    par = generate(stories_server.url, text=PROMPT, sampling_params={**greedy(5), "n": 3})
    assert len(par) == 3 and len({o["text"] for o in par}) == 1


def test_logprobs_are_triples(stories_server):
    out = generate(stories_server.url, text=PROMPT, sampling_params=greedy(4),
                   return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True,
                   logprob_start_len=0)
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t[1] for t in lps] == out["output_ids"]
    assert all(t[0] <= 0 and isinstance(t[2], str) for t in lps)
    assert len(meta["output_top_logprobs"]) == 4
    assert all(len(pos) == 2 for pos in meta["output_top_logprobs"])
    # greedy: the chosen token is the best alternative
    assert [pos[0][1] for pos in meta["output_top_logprobs"]] == out["output_ids"]
    assert "input_token_logprobs" in meta


def test_info_routes(stories_server):
    url = stories_server.url
    info = httpx.get(url + "/model_info").json()
    assert info["model_path"].endswith("stories260K") and info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert httpx.get(url + "/get_model_info").json() == info
    assert httpx.get(url + "/weight_version").json() == {"weight_version": "default"}
    assert httpx.get(url + "/get_weight_version").status_code == 200
    server = httpx.get(url + "/server_info", timeout=30).json()
    assert server["port"] == stories_server.port and server["engine_pid"] > 0
    assert server["internal_states"][0]["num_running_reqs"] == 0
    assert httpx.get(url + "/get_server_info", timeout=30).status_code == 200
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == info["model_path"]
    assert httpx.get(url + "/health").status_code == 200


def test_flush_cache_and_abort(stories_server):
    url = stories_server.url
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    assert httpx.get(url + "/flush_cache", timeout=30).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(generate, url, text=PROMPT, rid="to-abort",
                          sampling_params={**greedy(400), "ignore_eos": True})
        frames = 0
        while frames < 50 and not fut.done():
            r = httpx.post(url + "/flush_cache", timeout=30)
            if r.status_code == 400:
                assert r.json()["error"]["message"]
                break
            frames += 1
        assert httpx.post(url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
        out = fut.result(timeout=TIMEOUT)
    if out["meta_info"]["completion_tokens"] < 400:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"


def _samples(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_metrics_counters_match_requests(stories_server):
    url = stories_server.url
    before = _samples(url)
    for i in range(3):
        generate(url, text=PROMPT, sampling_params=greedy(5 + i))
    stream_generate(url, text=PROMPT, sampling_params=greedy(4))
    httpx.get(url + "/health_generate", timeout=60)  # probes are not counted
    after = _samples(url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("sglang:num_requests_total") == 4
    assert delta("sglang:generation_tokens_total") == 5 + 6 + 7 + 4
    assert delta("sglang:prompt_tokens_total") == 4 * 5
    assert delta("sglang:e2e_request_latency_seconds_count") == 4
    assert delta("sglang:time_to_first_token_seconds_count") == 4
    assert delta("sglang:inter_token_latency_seconds_count") == (5 + 6 + 7 + 4) - 4
    assert after["sglang:num_running_reqs"] == 0
    for gauge in ("sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"):
        assert gauge in after


def test_completions_echo_prepends_prompt_and_its_logprobs(stories_server):
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 3,
            "temperature": 0, "logprobs": 1, "echo": True}
    r = httpx.post(stories_server.url + "/v1/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert choice["text"] == "Once upon a time, there was"
    lp = choice["logprobs"]
    # BOS + 4 prompt tokens, then 3 output tokens; nothing predicts the first token
    assert len(lp["tokens"]) == 8 and lp["token_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert lp["tokens"][-3:] == [",", " there", " was"]
    bad = httpx.post(stories_server.url + "/v1/completions", json={**body, "stream": True},
                     timeout=60)
    assert bad.status_code == 400 and "echo" in bad.text
