"""Test helper: drive ``engine.worker.run_engine`` in a spawned process over ZMQ, the way the
API process does (it binds both sockets; the engine connects), without the HTTP server.

    with EngineProcess(EngineArgs(model_path=..., tp_size=2)) as eng:
        eng.generate([1, 2, 3], max_new_tokens=8)   # -> output token ids
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Any

import zmq

from engine.config import EngineArgs
from engine.io_struct import (BatchOutput, ControlReq, ControlResp, GenerateReqInput, ReadyMsg,
                              StartupError)
from engine.types import SamplingParams
from engine.worker import run_engine

STARTUP_TIMEOUT_S = 120.0


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` from /proc (no psutil)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class EngineProcess:
    """One engine deployment (rank 0 + the ranks it spawns). ``ready`` is the ReadyMsg."""

    def __init__(self, args: EngineArgs, wait: bool = True):
        self.dir = tempfile.mkdtemp(prefix="eyrie-tp-test-")
        self.in_addr = f"ipc://{os.path.join(self.dir, 'in')}"
        self.out_addr = f"ipc://{os.path.join(self.dir, 'out')}"
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(self.in_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.out_addr)
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=run_engine, args=(args, self.in_addr, self.out_addr),
                                kwargs={"log_level": os.environ.get("EYRIE_TEST_LOG", "warning")})
        self.proc.start()
        self.ready: Any = None
        self._next_id = 0
        if wait:
            self.ready = self.recv(STARTUP_TIMEOUT_S)
            if not isinstance(self.ready, ReadyMsg):
                self.close()
                raise RuntimeError(f"engine did not start: {self.ready!r}")

    def recv(self, timeout: float) -> Any:
        """The next message from the engine; raises TimeoutError."""
        if not self.pull.poll(int(timeout * 1000)):
            raise TimeoutError(f"no engine message in {timeout} s "
                               f"(alive={self.proc.is_alive()})")
        return self.pull.recv_pyobj()

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 8,
                 timeout: float = 60.0, **sp: Any) -> list[list[int]]:
        """Run prompts (one batch) to completion; returns output ids per prompt."""
        rids = []
        for ids in prompts:
            self._next_id += 1
            rid = f"r{self._next_id}"
            rids.append(rid)
            params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new_tokens,
                                               "ignore_eos": True, **sp})
            self.push.send_pyobj(GenerateReqInput(rid, list(ids), params))
        out = {r: [] for r in rids}
        done: set[str] = set()
        deadline = time.time() + timeout
        while len(done) < len(rids):
            msg = self.recv(max(0.1, deadline - time.time()))
            if isinstance(msg, BatchOutput):
                for o in msg.outputs:
                    if o.rid in out:
                        assert o.error is None, o.error
                        out[o.rid] += o.new_output_ids
                        if o.finished:
                            done.add(o.rid)
        return [out[r] for r in rids]

    def control(self, method: str, timeout: float = 30.0, **kwargs: Any) -> ControlResp:
        self._next_id += 1
        self.push.send_pyobj(ControlReq(self._next_id, method, kwargs))
        deadline = time.time() + timeout
        while True:
            msg = self.recv(max(0.1, deadline - time.time()))
            if isinstance(msg, ControlResp) and msg.req_id == self._next_id:
                return msg

    def close(self) -> None:
        """Stop like the server does: SIGTERM, then SIGKILL after 5 s."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["EngineProcess", "StartupError", "child_pids", "pid_alive"]
