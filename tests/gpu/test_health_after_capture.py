"""On GPU: a pre-ready phase (weights, KV, CUDA-graph capture, warm-up, plus a test-only delay)
longer than the health timeout must not make the first /health_generate after ready a 503."""

import time

import httpx
import pytest
import torch

from tests.e2e.harness import STORIES, ServerProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

READY_LINE = "The server is fired up and ready to roll!"


def test_first_probe_after_graph_capture_is_200():
    server = ServerProcess(["--model-path", STORIES, "--device", "cuda",
                            "--health-check-timeout", "2", "--debug-startup-delay", "4"])
    try:
        t0, seen_503 = time.time(), False
        while READY_LINE not in server.log():
            assert time.time() - t0 < 300 and server.proc.poll() is None, server.log()[-3000:]
            try:
                code = httpx.get(server.url + "/health_generate", timeout=30).status_code
            except httpx.TransportError:
                code = None
            if READY_LINE not in server.log():
                assert code in (None, 503)
                seen_503 |= code == 503
            time.sleep(0.2)
        assert "Capture cuda graph end" in server.log()
        assert seen_503 and time.time() - t0 > 2
        assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    finally:
        server.kill()
