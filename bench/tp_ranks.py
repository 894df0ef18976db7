"""Run one function on ``tp_size`` tensor-parallel rank processes, started the way the engine
starts its ranks (``engine.worker.run_rank``): spawn, die with the parent, TCPStore + NCCL
(cuda) or gloo (cpu) default group + gloo CPU group, GPU = rank. Each rank calls
``fn(*args, ps)`` with its own ``ParallelState``; ``fn`` must issue the same collectives in the
same order on every rank (a benchmark that steps identical schedulers over identical requests).

    run_ranks(bench, 2, (args, model_dir))   # returns when every rank is done
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from typing import Any, Callable

from engine.distributed import launch


def _rank_main(rank: int, tp_size: int, device: str, fn: Callable[..., None], args: tuple,
               addr: str, done: Any, parent_pid: int) -> None:
    """Dies with its parent, leaves Ctrl-C to the parent, joins the TCPStore at ``addr`` and
    the groups (``init_parallel_state`` pins GPU ``rank`` first), runs ``fn``; rank 0 then
    sets ``done``. Ends with a barrier and ``destroy_process_group``."""
    launch.die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launch.limit_threads(tp_size)
    store, _ = launch.create_store(addr, rank, tp_size)
    ps = launch.init_parallel_state(store, rank, tp_size, device)
    fn(*args, ps)
    if rank == 0:
        done.set()
    ps.barrier()
    import torch.distributed as dist
    dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], tp_size: int, args: tuple, device: str = "cuda",
              exit_grace_s: float = 30.0) -> None:
    """Spawn ``tp_size`` ranks running ``fn(*args, ps)`` (``fn`` and ``args`` must pickle) and
    wait for them. Raises SystemExit(1) as soon as a rank exits non-zero before rank 0's ``fn``
    has returned (multiprocessing prints the rank's traceback to stderr). Every way out stops
    the ranks still running (SIGTERM, then SIGKILL after 3 s); ranks still alive
    ``exit_grace_s`` seconds after rank 0's ``fn`` returned are a teardown hang, not a failed
    run: they are killed with a warning."""
    with socket.socket() as s:  # a port that was free a moment ago; rank 0 listens on it
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    mp = multiprocessing.get_context("spawn")
    done = mp.Event()
    procs = []
    try:
        for rank in range(tp_size):
            p = mp.Process(target=_rank_main, name=f"tp-rank{rank}", daemon=True,
                           args=(rank, tp_size, device, fn, args, addr, done, os.getpid()))
            p.start()
            procs.append(p)
        pending = {p.sentinel: p for p in procs}
        deadline = None
        while pending:
            if deadline is None and done.is_set():
                deadline = time.monotonic() + exit_grace_s
            if deadline is not None and time.monotonic() > deadline:
                print(f"warning: {[p.name for p in pending.values()]} still alive "
                      f"{exit_grace_s:.0f} s after rank 0 finished; killing them", file=sys.stderr)
                return
            for sentinel in multiprocessing.connection.wait(list(pending), timeout=1.0):
                p = pending.pop(sentinel)
                p.join()
                if p.exitcode == 0:
                    continue
                if done.is_set():
                    print(f"warning: {p.name} exited with code {p.exitcode} after rank 0 "
                          "finished", file=sys.stderr)
                    continue
                print(f"error: {p.name} (pid {p.pid}) exited with code {p.exitcode}; stopping "
                      "the other ranks", file=sys.stderr)
                raise SystemExit(1)
    finally:
        launch.stop_ranks(procs)
