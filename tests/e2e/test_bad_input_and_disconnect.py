"""Bad input gets a 4xx naming the field and leaves the server up; clients that go away have
their requests aborted."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

PROMPT = "Once upon a time"
GOOD = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}


def sp(**kw) -> dict:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, **kw}}


# (body, field the error message must name)
NATIVE_CASES = [
    ({"text": ""}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({}, "text"),
    ({"text": "Once upon a time " * 200}, "text"),  # longer than the 512-token context
    (sp(temperature=-0.5), "temperature"),
    (sp(top_p=0), "top_p"),
    (sp(top_p=1.5), "top_p"),
    (sp(top_k=0), "top_k"),
    (sp(top_k=-2), "top_k"),
    (sp(min_p=-0.1), "min_p"),
    (sp(min_p=1.5), "min_p"),
    (sp(max_new_tokens=-1), "max_new_tokens"),
    (sp(n=0), "n"),
    (sp(temperature="hot"), "temperature"),
    (sp(no_such_param=1), "no_such_param"),
    ({"input_ids": [1, 512]}, "input_ids"),  # vocab is 512
    ({"input_ids": [1, -3]}, "input_ids"),
    ({"text": 123}, "text"),
    ({"text": PROMPT, "sampling_params": "greedy"}, "sampling_params"),
    ({"text": PROMPT, "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("body,field", NATIVE_CASES)
def test_native_bad_input_is_400_naming_field(stories_server, body, field):
    r = httpx.post(stories_server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_malformed_json_is_400(stories_server):
    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
        r = httpx.post(stories_server.url + route, content=b'{"text": "abc",',
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text
        body = r.json()
        msg = body["message"] if route.startswith("/v1") else body["error"]["message"]
        assert "JSON" in msg


OPENAI_CASES = [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/completions", {"prompt": PROMPT, "suffix": " the end"}, "suffix"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.1.type"),
]


@pytest.mark.parametrize("route,body,field", OPENAI_CASES)
def test_openai_bad_input_is_400_error_object(stories_server, route, body, field):
    r = httpx.post(stories_server.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400
    assert field in err["message"] and err["param"].startswith(field)


def test_unknown_model_is_404(stories_server):
    r = httpx.post(stories_server.url + "/v1/completions",
                   json={"model": "no-such-model", "prompt": PROMPT}, timeout=60)
    assert r.status_code == 404 and r.json()["object"] == "error"
    assert httpx.get(stories_server.url + "/v1/models/no-such-model").status_code == 404


def test_server_survives_bad_input(stories_server):
    pid = stories_server.engine_pid()
    for body, _ in NATIVE_CASES:
        httpx.post(stories_server.url + "/generate", json=body, timeout=60)
    r = httpx.post(stories_server.url + "/generate", json=GOOD, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    assert stories_server.engine_pid() == pid
    assert stories_server.proc.poll() is None


def test_duplicate_rid_is_400_and_the_first_request_finishes(stories_server):
    url = stories_server.url
    body = {"text": PROMPT, "rid": "dup-1", "stream": True,
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as first:
        frames = first.iter_lines()
        next(line for line in frames if line.startswith("data: "))  # in flight now
        second = httpx.post(url + "/generate", json={**body, "stream": False}, timeout=60)
        assert second.status_code == 400, second.text
        assert "rid" in second.json()["error"]["message"]
        last = [line for line in frames if line.startswith("data: {")][-1]
    assert json.loads(last[len("data: "):])["meta_info"]["completion_tokens"] == 64
    batch = httpx.post(url + "/generate", json={"text": [PROMPT, PROMPT], "rid": ["x1", "x1"],
                                                "sampling_params": {"max_new_tokens": 2}},
                       timeout=60)
    assert batch.status_code == 400 and "rid" in batch.json()["error"]["message"]


def _running(url: str) -> tuple[int, int]:
    info = httpx.get(url + "/server_info", timeout=30).json()
    state = info["internal_states"][0]
    return state["num_running_reqs"] + state["num_waiting_reqs"], info["num_pending_requests"]


def _generated(url: str) -> int:
    info = httpx.get(url + "/server_info", timeout=30).json()
    return info["internal_states"][0]["generation_tokens"]


def test_disconnecting_stream_clients_are_aborted(stories_server):
    url = stories_server.url
    long_body = {"text": PROMPT, "stream": True,
                 "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    started = threading.Barrier(11)
    before = _generated(url)

    def client() -> None:
        with httpx.stream("POST", url + "/generate", json=long_body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break
            started.wait(timeout=60)
        # leaving the block closes the connection mid-generation

    threads = [threading.Thread(target=client) for _ in range(10)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    for t in threads:
        t.join(timeout=60)
    time.sleep(2.0)
    assert _running(url) == (0, 0)
    assert _generated(url) - before < 10 * 480 // 2  # stopped early, not run to the end


def test_disconnecting_non_stream_client_is_aborted(stories_server):
    url = stories_server.url
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    before = _generated(url)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/generate", json=body, timeout=0.5)
    time.sleep(1.5)
    assert _running(url) == (0, 0)
    assert _generated(url) - before < 480
