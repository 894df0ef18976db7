"""The TP engine process tree through ``run_engine`` (the server's entry point) on CPU/gloo:
serving, merged control answers, clean shutdown without orphans, a dead rank killing the
engine, and a taken ``--dist-init-addr`` port failing start-up with a clear message."""

from __future__ import annotations

import os
import signal
import socket
import time

from engine.config import EngineArgs
from engine.distributed.parallel_state import ParallelState
from engine.io_struct import StartupError
from tests.conftest import STORIES
from tests.tp_engine import EngineProcess, child_pids, generate_on_rank, pid_alive

PROMPTS = [[1, 403, 407, 261], [1, 5, 6, 7, 8]]


def _args(**kw) -> EngineArgs:
    base = dict(model_path=STORIES, dtype="float32", device="cpu", max_total_tokens=2048,
                max_running_requests=8)
    return EngineArgs(**{**base, **kw})


def _rank_pids(leader: int) -> list[int]:
    """The TP rank processes spawned by ``leader`` (not multiprocessing's resource tracker)."""
    pids = []
    for pid in child_pids(leader):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


def _wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_tp2_engine_matches_tp1_merges_control_and_exits_cleanly():
    ref = generate_on_rank(_args(skip_warmup=True), ParallelState(), PROMPTS, 10)[:len(PROMPTS)]
    eng = EngineProcess(_args(tp_size=2))
    try:
        ranks = _rank_pids(eng.proc.pid)
        assert len(ranks) == 1
        assert eng.generate(PROMPTS, max_new_tokens=10) == ref
        flushed = eng.control("flush_cache")
        assert flushed.success and flushed.message == "Cache flushed."
        state = eng.control("get_internal_state")
        assert state.success and state.data["kv_total_tokens"] == 2048
    finally:
        eng.close()  # SIGTERM, as the server does
    assert eng.proc.exitcode == 0
    assert _wait_gone(ranks, 5.0), "a TP rank outlived rank 0"


def test_killing_a_nonzero_rank_makes_rank0_exit():
    eng = EngineProcess(_args(tp_size=2, skip_warmup=True))
    try:
        (rank1,) = _rank_pids(eng.proc.pid)
        t0 = time.time()
        os.kill(rank1, signal.SIGKILL)
        eng.proc.join(10)
        assert not eng.proc.is_alive(), "rank 0 kept running after rank 1 died"
        assert time.time() - t0 < 5.0
        assert eng.proc.exitcode != 0
    finally:
        eng.close()


def test_dist_init_port_in_use_is_a_clear_startup_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        eng = EngineProcess(_args(tp_size=2, dist_init_addr=f"127.0.0.1:{port}"), wait=False)
        try:
            msg = eng.recv(60)
            assert isinstance(msg, StartupError)
            assert f"127.0.0.1:{port}" in msg.message and "in use" in msg.message
            eng.proc.join(10)
            assert not eng.proc.is_alive() and eng.proc.exitcode != 0
        finally:
            eng.close()


def test_multinode_without_dist_init_addr_fails_startup():
    eng = EngineProcess(_args(tp_size=2, nnodes=2), wait=False)
    try:
        msg = eng.recv(60)
        assert isinstance(msg, StartupError) and "nnodes" in msg.message
    finally:
        eng.close()
