"""``/health`` and ``/health_generate`` through start-up, load, an engine hang and engine death.

The server starts with a test-only start-up delay longer than the health-check timeout, which
proves the heartbeat reset: the first probe after the ready line is 200, not 503.
Tests run in file order on one server; the last one kills its engine.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness import STORIES, post_in_background

TIMEOUT_S = 4.0
STARTUP_DELAY_S = 8.0
READY_LINE = "The server is fired up and ready to roll!"
LONG = {"text": "Once upon a time",
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(launch):
    return launch(["--model-path", STORIES, "--health-check-timeout", str(TIMEOUT_S),
                   "--debug-startup-delay", str(STARTUP_DELAY_S)], wait=False)


def _get(url: str, timeout: float = 60) -> int | None:
    try:
        return httpx.get(url, timeout=timeout).status_code
    except httpx.TransportError:
        return None  # not listening yet


def test_503_while_starting_then_200_on_first_probe_after_ready(server):
    t0 = time.time()
    seen_503 = False
    while READY_LINE not in server.log():
        assert time.time() - t0 < 300, server.log()[-3000:]
        assert server.proc.poll() is None, server.log()[-3000:]
        code = _get(server.url + "/health_generate")
        if READY_LINE in server.log():
            break  # this probe may have raced the ready line
        assert code in (None, 503), "200 before the server was ready"
        if code == 503:
            seen_503 = True
            health = _get(server.url + "/health")
            assert health == 503 or READY_LINE in server.log()
        time.sleep(0.2)
    assert seen_503
    assert time.time() - t0 > TIMEOUT_S  # the pre-ready phase outlasted the probe timeout
    assert _get(server.url + "/health_generate") == 200
    assert _get(server.url + "/health") == 200


def test_200_while_busy_with_long_requests(server):
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(httpx.post, server.url + "/generate", json=LONG, timeout=300)
                for _ in range(3)]
        time.sleep(0.5)
        for _ in range(3):
            t = time.time()
            assert _get(server.url + "/health_generate") == 200
            assert time.time() - t < TIMEOUT_S
        assert all(f.result().status_code == 200 for f in futs)


def test_hung_engine_gives_503_then_recovers(server):
    pid = server.engine_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.time()
        assert _get(server.url + "/health_generate") == 503
        assert TIMEOUT_S - 0.5 <= time.time() - t <= TIMEOUT_S + 5
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _get(server.url + "/health_generate") == 200


def test_dead_engine_gives_503_and_fails_pending_requests(server):
    pid = server.engine_pid()
    pending, results = post_in_background(server.url + "/generate", LONG, timeout=300)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    t = time.time()
    codes = []
    while time.time() - t < TIMEOUT_S + 5:
        codes.append(_get(server.url + "/health_generate"))
        if codes[-1] == 503:
            break
    assert codes[-1] == 503 and 200 not in codes[1:], codes
    assert _get(server.url + "/health") != 200
    pending.join(timeout=60)
    assert results == [503]
    # never a stale 200 afterwards, and new work is refused
    assert _get(server.url + "/health_generate") == 503
    r = httpx.post(server.url + "/generate", json=LONG, timeout=30)
    assert r.status_code == 503
