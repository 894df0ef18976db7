"""Test helpers for tensor parallelism (kept free of ``transformers`` imports: spawned ranks
import this module, and on a 2-core CI box every second of import counts).

* ``EngineProcess``: drive ``engine.worker.run_engine`` in a spawned process over ZMQ, the way
  the API process does (it binds both sockets; the engine connects), without the HTTP server.

      with EngineProcess(EngineArgs(model_path=..., tp_size=2)) as eng:
          eng.generate([[1, 2, 3]], max_new_tokens=8)   # -> output token ids per prompt

* ``run_tp_ranks``: spawn ``tp`` ranks that each run the real per-rank start-up path and step
  their schedulers in lockstep over several models; returns every rank's tokens.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import socket
import tempfile
import time
from typing import Any

import zmq

from engine.config import EngineArgs
from engine.distributed import launch
from engine.distributed.parallel_state import ParallelState
from engine.io_struct import (BatchOutput, ControlReq, ControlResp, GenerateReqInput, ReadyMsg,
                              StartupError)
from engine.types import SamplingParams
from engine.worker import run_engine, start_scheduler

STARTUP_TIMEOUT_S = 120.0


def _live_procs():
    """(pid, /proc/<pid>/stat fields after the command name) of every live non-zombie
    process (fields[1] = ppid, fields[3] = session id); no psutil."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            yield int(entry), fields


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    return [p for p, fields in _live_procs() if int(fields[1]) == pid]


def session_pids(sid: int) -> list[int]:
    """Processes of session ``sid``: a server started with ``start_new_session`` and everything
    it spawned, even if re-parented to init."""
    return [p for p, fields in _live_procs() if int(fields[3]) == sid]


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
        return [ids for ids, _ in self.generate_top(prompts, max_new_tokens, 0, timeout, **sp)]

    def generate_top(self, prompts: list[list[int]], max_new_tokens: int, top: int,
                     timeout: float = 60.0, **sp: Any) -> list[tuple[list[int], list]]:
        """Like ``generate``, also returning per prompt the ``top`` (logprob, token id) pairs
        of every output position (empty lists when ``top`` is 0)."""
        rids = []
        for ids in prompts:
            self._next_id += 1
            rid = f"r{self._next_id}"
            rids.append(rid)
            params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new_tokens,
                                               "ignore_eos": True, **sp})
            self.push.send_pyobj(GenerateReqInput(rid, list(ids), params, return_logprob=top > 0,
                                                  top_logprobs_num=top))
        out: dict[str, list[int]] = {r: [] for r in rids}
        tops: dict[str, list] = {r: [] for r in rids}
        done: set[str] = set()
        deadline = time.time() + timeout
        while len(done) < len(rids):
            msg = self.recv(max(0.1, deadline - time.time()))
            if isinstance(msg, BatchOutput):
                for o in msg.outputs:
                    if o.rid in out:
                        assert o.error is None, o.error
                        out[o.rid] += o.new_output_ids
                        tops[o.rid] += o.output_top_logprobs
                        if o.finished:
                            done.add(o.rid)
        return [(out[r], tops[r]) for r in rids]

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


def generate_on_rank(args: EngineArgs, ps: ParallelState, prompts: list[list[int]],
                     max_new_tokens: int) -> list[list[int]]:
    """Greedy outputs of ``prompts`` (one batch), then one sampled continuation (temperature 1,
    top_k 20, unseeded: its draws come from the sampler seed that rank 0 shares)."""
    sched = start_scheduler(args, ps, None)
    jobs = [(f"g{i}", p, {"temperature": 0}) for i, p in enumerate(prompts)]
    jobs.append(("s", prompts[0], {"temperature": 1.0, "top_k": 20}))
    out: dict[str, list[int]] = {}
    for rid, ids, sp in jobs:
        params = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                           **sp})
        sched.add_request(GenerateReqInput(rid, list(ids), params))
        out[rid] = []
    while sched.busy:
        for o in sched.step():
            out[o.rid] += o.new_output_ids
    return [out[rid] for rid, _, _ in jobs]


def _rank_main(rank: int, jobs: list[tuple[EngineArgs, list[list[int]], int]], addr: str,
               results: Any, parent: int) -> None:
    tp = jobs[0][0].tp_size
    launch.die_with_parent(parent)
    launch.limit_threads(tp)
    store, _ = launch.create_store(addr, rank, tp)
    ps = launch.init_parallel_state(store, rank, tp, "cpu")
    for i, (args, prompts, n) in enumerate(jobs):
        results.put((rank, i, generate_on_rank(args, ps, prompts, n)))
    ps.barrier()


def run_tp_ranks(jobs: list[tuple[EngineArgs, list[list[int]], int]],
                 timeout: float = 90.0) -> list[list[list[list[int]]]]:
    """Run each job ``(args, prompts, max_new_tokens)`` on ``args.tp_size`` spawned CPU ranks
    (all jobs share one tp size). Returns ``out[rank][job]`` = outputs per prompt (+ the
    sampled one). Raises AssertionError naming the exit codes when the ranks stall."""
    tp = jobs[0][0].tp_size
    with socket.socket() as s:  # a port that was free a moment ago; rank 0 listens on it
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, jobs, addr, results, os.getpid()),
                         daemon=True) for r in range(tp)]
    for p in procs:
        p.start()
    out: list[list[Any]] = [[None] * len(jobs) for _ in range(tp)]
    try:
        for _ in range(tp * len(jobs)):
            try:
                rank, i, toks = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"tp={tp} ranks stalled; exit codes "
                                     f"{[p.exitcode for p in procs]}") from None
            out[rank][i] = toks
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return out


__all__ = ["EngineProcess", "StartupError", "child_pids", "generate_on_rank", "pid_alive",
           "run_tp_ranks", "session_pids"]
