"""Command-line behaviour: a taken port is a clear error before the engine starts; the API key
guards every route except health and metrics."""

from __future__ import annotations

import subprocess
import sys

import httpx

from harness import REPO, STORIES, free_port, run_on_taken_port


def test_port_in_use_is_a_clear_error():
    r, port = run_on_taken_port([])
    assert r.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr
    assert "starting the engine" not in r.stderr  # checked before spawning the engine


def test_help_lists_sglang_flags():
    r = subprocess.run([sys.executable, "-m", "server", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for flag in ("--model-path", "--tokenizer-path", "--host", "--port", "--dtype", "--device",
                 "--context-length", "--page-size", "--max-running-requests",
                 "--chunked-prefill-size", "--max-total-tokens", "--mem-fraction-static",
                 "--disable-radix-cache", "--load-format", "--served-model-name", "--api-key",
                 "--log-level", "--random-seed", "--health-check-timeout", "--weight-version",
                 "--skip-server-warmup", "--debug-startup-delay"):
        assert flag in r.stdout, flag


def test_api_key_weight_version_and_served_name(launch):
    srv = launch(["--model-path", STORIES, "--api-key", "sekrit", "--weight-version", "v7",
                  "--served-model-name", "tiny", "--skip-server-warmup"])
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(srv.url + "/generate", json=body, timeout=60).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert httpx.post(srv.url + "/generate", json=body, headers=bad,
                      timeout=60).status_code == 401
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert r.status_code == 401 and r.json()["object"] == "error"
    ok = {"Authorization": "Bearer sekrit"}
    r = httpx.post(srv.url + "/generate", json=body, headers=ok, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "v7"
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/metrics").status_code == 200
    models = httpx.get(srv.url + "/v1/models", headers=ok).json()
    assert models["data"][0]["id"] == "tiny"
    r = httpx.post(srv.url + "/v1/completions", headers=ok, timeout=60,
                   json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["metadata"] == {"weight_version": "v7"}
    assert httpx.get(srv.url + "/weight_version", headers=ok).json() == {"weight_version": "v7"}
    assert free_port() != srv.port
