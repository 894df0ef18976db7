"""Multi-node TP the SGLang way, both "nodes" on this host: two real ``python -m server``
processes with ``--tp-size 2 --nnodes 2 --node-rank {0,1} --dist-init-addr 127.0.0.1:P``.

Node 0 serves HTTP and global rank 0; node 1 runs rank 1 and no HTTP. Proven here: node 0's
greedy tokens equal tp=1's (float32 CPU); node 1 binds no port; SIGTERM to node 0 stops node 1
too (both exit 0, nothing left in either process session); killing node 1 turns node 0's
``/health_generate`` 503 within its timeout and fails the pending request with 503; a node that
never joins is an error naming it after the rendezvous timeout; a taken HTTP port on node 0 is
still a clear error before any engine starts (a taken ``--dist-init-addr`` port: see
tests/unit/test_tp_worker.py). Every process is killed at module teardown whatever happened.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import pytest

from harness import (STORIES, ServerProcess, free_port, post_in_background,
                     run_on_taken_port)
from engine.config import EngineArgs
from engine.distributed import launch as dist_launch
from engine.distributed.parallel_state import ParallelState
from tests.tp_engine import generate_on_rank, session_pids

TIMEOUT_S = 4.0  # --health-check-timeout of node 0
PROMPTS = [[1, 403, 407, 261, 378], [1, 334, 300, 450]]
NEW = 12
LONG = {"text": "Once upon a time",
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
NODE1_LINE = "no HTTP server on this node"


def _wait_exit(srv: ServerProcess, timeout: float) -> int:
    """The exit code of ``srv`` and then, within ``timeout`` s, no process left in its session."""
    code = srv.proc.wait(timeout=timeout)
    deadline = time.time() + timeout
    while session_pids(srv.proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert session_pids(srv.proc.pid) == [], f"left behind by {srv.proc.pid}:\n{srv.log()}"
    return code


def _start_pair(launch, extra: list[str] = ()) -> tuple[ServerProcess, ServerProcess]:
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model-path", STORIES, "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", addr, *extra]
    node0 = launch([*common, "--node-rank", "0", "--health-check-timeout", str(TIMEOUT_S)],
                   wait=False)
    node1 = launch([*common, "--node-rank", "1"], wait=False)
    node0.wait_ready()
    assert node1.proc.poll() is None, node1.log()
    return node0, node1


@pytest.fixture(scope="module")
def tp1_tokens() -> list[list[int]]:
    """Greedy tokens of a tp=1 engine (float32 CPU), in this process."""
    args = EngineArgs(model_path=STORIES, dtype="float32", device="cpu", max_total_tokens=2048,
                      skip_warmup=True)
    return generate_on_rank(args, ParallelState(), PROMPTS, NEW)[:len(PROMPTS)]


def _generate(url: str) -> list[list[int]]:
    body = {"input_ids": PROMPTS,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_node0_serves_tp1_tokens_and_its_sigterm_stops_node1(launch, tp1_tokens):
    node0, node1 = _start_pair(launch, ["--skip-server-warmup"])
    assert _generate(node0.url) == tp1_tokens
    assert NODE1_LINE in node1.log() and _refused(node1.port)  # node 1 serves no HTTP
    os.kill(node0.proc.pid, signal.SIGTERM)  # the server process only, as a supervisor would
    assert _wait_exit(node0, 30) == 0
    assert _wait_exit(node1, 30) == 0, node1.log()
    assert "node 0 stopped the deployment" in node1.log()


def test_killing_node1_turns_node0_health_503_and_fails_pending_requests(launch):
    node0, node1 = _start_pair(launch, ["--skip-server-warmup"])
    engine0 = node0.engine_pid()
    pending, results = post_in_background(node0.url + "/generate", LONG, timeout=120)
    time.sleep(0.5)
    os.kill(node1.proc.pid, signal.SIGKILL)  # its engine must not outlive it
    t0 = time.time()
    assert httpx.get(node0.url + "/health_generate", timeout=60).status_code == 503
    assert time.time() - t0 <= TIMEOUT_S + 3
    pending.join(timeout=60)
    assert results == [503]
    assert httpx.get(node0.url + "/health").status_code == 503  # the API saw its engine exit
    assert engine0 not in session_pids(node0.proc.pid), "node 0's engine outlived node 1"
    _wait_exit(node1, 15)
    node0.proc.send_signal(signal.SIGTERM)
    assert _wait_exit(node0, 30) == 0


def test_a_node_that_never_joins_is_an_error_naming_it():
    store, _ = dist_launch.create_store("127.0.0.1:0", 0, 4)
    t0 = time.time()
    with pytest.raises(dist_launch.DistInitError) as err:
        dist_launch.wait_for_ranks(store, 0, 4, nnodes=2, timeout_s=1.0)
    assert time.time() - t0 < 10
    assert "TP ranks [1, 2, 3] (--node-rank 0, 1) did not join within 1 s" in str(err.value)


def test_taken_http_port_on_node0_fails_before_any_engine_starts():
    r, port = run_on_taken_port(["--tp-size", "2", "--nnodes", "2", "--node-rank", "0",
                                 "--dist-init-addr", f"127.0.0.1:{free_port()}"])
    assert r.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr
    assert "starting the engine" not in r.stderr
