"""Process groups and rank processes for tensor parallelism (one process per deployment TP rank).

Layout (SGLang's ``--nnodes/--node-rank/--dist-init-addr``): ``tp_size`` ranks split evenly over
``nnodes`` nodes; node ``k`` runs global ranks ``k * per_node .. (k + 1) * per_node - 1`` and its
first rank (the *node leader*, started by the server) spawns the others with the ``spawn``
context. Global rank 0 hosts the ``TCPStore`` at ``--dist-init-addr`` (default: a free port on
127.0.0.1, chosen by the OS so two servers never race for it).

Groups: ``tp_group`` is NCCL on CUDA and gloo on CPU (the model's all-reduce / all-gather);
``cpu_group`` is always gloo (control messages, KV sizing), so CPU-only CI runs real TP.

Start-up: every rank checks in at the store (``wait_for_ranks``) before joining the groups, so a
node that never shows up is a ``DistInitError`` naming it after ``INIT_TIMEOUT_S`` instead of a
30-minute hang inside ``init_process_group``.

Lifecycle: spawned ranks ask the kernel for SIGKILL when their leader dies (``PR_SET_PDEATHSIG``)
and ignore SIGINT (the leader drives shutdown); the leader runs a ``RankWatchdog`` thread that
exits the leader as soon as any of its ranks exits, so a dead rank never leaves a half-alive
engine that would hang in the next collective. Leaders of nodes k > 0 die with their server
process the same way. Ranks on *other* nodes are not watched by a thread: the gloo CPU group is
the heartbeat. Rank 0 broadcasts every loop iteration (``engine.worker.IDLE_POLL_MS`` apart when
idle), and gloo fails that broadcast, or any collective, within milliseconds once a peer's sockets
close ("Connection closed by peer"), so a dead node ends every other node's engine and node 0's
API answers 503. (A hung node is caught by ``/health_generate``'s timeout instead; on GPU a rank
stuck in an NCCL collective with a dead peer waits for ``COLLECTIVE_TIMEOUT_S``.) A clean stop
travels the same way: rank 0 broadcasts ``stop`` and every rank returns.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.config import EngineArgs
from engine.distributed.parallel_state import ParallelState

logger = logging.getLogger("engine.distributed")

# Rendezvous (store connect, init_process_group) must finish within this; it happens before
# weights load, so a minute is generous and a wrong address fails instead of hanging.
INIT_TIMEOUT_S = 60
# Collective timeout; a dead rank is caught by the watchdog long before this.
COLLECTIVE_TIMEOUT_S = 1800
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class DistInitError(RuntimeError):
    """torch.distributed could not start: address in use, unreachable peer, bad flags."""


@dataclass(frozen=True)
class RankLayout:
    """Which global TP ranks run on this node. ``local`` ranks index the node's GPUs."""

    tp_size: int
    nnodes: int
    node_rank: int

    @classmethod
    def from_args(cls, args: EngineArgs) -> "RankLayout":
        """Raises DistInitError when the flags do not describe an even split."""
        if args.nnodes < 1 or args.tp_size % args.nnodes:
            raise DistInitError(f"--tp-size {args.tp_size} must be a multiple of --nnodes "
                                f"{args.nnodes}")
        if not 0 <= args.node_rank < args.nnodes:
            raise DistInitError(f"--node-rank {args.node_rank} outside [0, {args.nnodes})")
        if args.nnodes > 1 and not args.dist_init_addr:
            raise DistInitError("--dist-init-addr host:port is required with --nnodes > 1")
        return cls(args.tp_size, args.nnodes, args.node_rank)

    @property
    def per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def leader_rank(self) -> int:
        return self.node_rank * self.per_node

    def local_rank(self, rank: int) -> int:
        return rank - self.leader_rank


def parse_addr(addr: str | None) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``[::1]:port``) -> (host, port); None -> ("127.0.0.1", 0)."""
    if not addr:
        return "127.0.0.1", 0
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise DistInitError(f"--dist-init-addr {addr!r} is not host:port")
    return host.strip("[]"), int(port)


def create_store(addr: str | None, rank: int, world_size: int,
                 timeout_s: float = INIT_TIMEOUT_S) -> tuple[Any, str]:
    """Rank 0 listens (port 0 = any free port), others connect, retrying for ``timeout_s``
    seconds (their node may start first). Returns (TCPStore, "host:port" actually used).
    Raises DistInitError naming the address on failure."""
    import torch.distributed as dist

    host, port = parse_addr(addr)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        what = "listen on" if rank == 0 else "reach"
        hint = " (is node 0 started, with the same --dist-init-addr?)" if rank else ""
        if "EADDRINUSE" in str(e) or "in use" in str(e):
            hint = " (port already in use? pass another --dist-init-addr or omit it)"
        raise DistInitError(f"TP rank {rank}: cannot {what} {host}:{port}{hint}: "
                            f"{str(e).splitlines()[0]}") from None
    return store, f"{host}:{store.port}"


def wait_for_ranks(store: Any, rank: int, world_size: int, nnodes: int = 1,
                   timeout_s: float = INIT_TIMEOUT_S) -> None:
    """Check in at the store as ``rank`` and wait up to ``timeout_s`` seconds until all
    ``world_size`` ranks have. Without this, a missing rank hangs ``init_process_group`` for the
    collective timeout. Raises DistInitError naming the missing ranks and their nodes."""
    keys = [f"eyrie/joined/{r}" for r in range(world_size)]
    try:
        store.set(keys[rank], "1")
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return
    except (RuntimeError, OSError) as e:
        error = str(e).splitlines()[0] if str(e) else type(e).__name__
    try:
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
    except (RuntimeError, OSError):  # rank 0's store itself is gone
        raise DistInitError(f"TP rank {rank}: lost the store of TP rank 0 during start-up: "
                            f"{error}") from None
    if not missing:
        raise DistInitError(f"TP rank {rank}: start-up rendezvous failed: {error}")
    per_node = world_size // nnodes
    nodes = ", ".join(str(n) for n in sorted({r // per_node for r in missing}))
    raise DistInitError(f"TP rank {rank}: TP ranks {missing} (--node-rank {nodes}) did not "
                        f"join within {timeout_s:g} s; start every node with the same "
                        f"--tp-size, --nnodes and --dist-init-addr") from None


def init_parallel_state(store: Any, rank: int, world_size: int, device: str,
                        nnodes: int = 1) -> ParallelState:
    """Wait for every rank (``wait_for_ranks``), then join the default group (NCCL on cuda,
    else gloo) and a gloo CPU group; set this rank's GPU (local rank = rank % GPUs on the
    node) before any CUDA work. Raises DistInitError if a rank is missing or a group fails."""
    import torch.distributed as dist

    wait_for_ranks(store, rank, world_size, nnodes)
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        cpu_group = dist.new_group(backend="gloo")
    except (RuntimeError, OSError) as e:
        raise DistInitError(f"TP rank {rank}: init_process_group failed: {e}") from None
    return ParallelState(tp_rank=rank, tp_size=world_size, tp_group=dist.group.WORLD,
                         cpu_group=cpu_group)


def limit_threads(per_node: int) -> None:
    """Share the host's cores between the ranks of one node (no oversubscription)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent exits; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the leader's watchdog still covers it
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


class StopOnSignal:
    """SIGTERM/SIGINT handler of a node leader (``install()`` it in the main thread).

    On global rank 0 while ``serving``, the first signal only sets ``requested``: the loop then
    broadcasts a stop, so every rank on every node returns cleanly (exit code 0) instead of
    failing its next collective. Otherwise (start-up, a second signal, leaders of nodes k > 0,
    which cannot stop the others) it raises SystemExit(0) at once; finally blocks stop the local
    ranks and peers on other nodes see their next collective fail.
    """

    def __init__(self, is_rank0: bool):
        self.is_rank0 = is_rank0
        self.serving = False
        self.requested = False

    def install(self) -> "StopOnSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self)
        return self

    def __call__(self, signum: int, frame: Any) -> None:
        if not (self.is_rank0 and self.serving) or self.requested:
            raise SystemExit(0)
        logger.info("signal %d: stopping once this step is done", signum)
        self.requested = True


def spawn_ranks(target: Callable[..., None], ranks: list[int], args: EngineArgs,
                store_addr: str, log_level: str) -> list[multiprocessing.Process]:
    """Start ``target(args, rank, store_addr, log_level=..., parent_pid=...)`` for each rank.

    Raises AssertionError if this process is a daemonic multiprocessing child (those may not
    have children): the server must start the engine with ``daemon=False``.
    """
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in ranks:
        p = ctx.Process(target=target, args=(args, rank, store_addr),
                        kwargs={"log_level": log_level, "parent_pid": os.getpid()},
                        name=f"eyrie-tp{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def stop_ranks(procs: list[multiprocessing.Process], timeout: float = 3.0) -> None:
    """SIGTERM, wait up to ``timeout`` s in total, then SIGKILL what is left."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


class RankWatchdog:
    """Exits this (leader) process as soon as one of ``procs`` exits unexpectedly.

    ``on_death(message)`` runs first (e.g. tell the API process why start-up failed); then the
    other ranks are killed and the process ends with ``os._exit(1)``, which also works while
    the main thread is blocked in a collective that the dead rank will never join.
    """

    def __init__(self, procs: list[multiprocessing.Process],
                 on_death: Callable[[str], None] | None = None):
        self.procs = procs
        self.on_death = on_death
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)

    def start(self) -> "RankWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Expected shutdown from here on: rank exits are no longer errors."""
        self._stopped.set()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        while not self._stopped.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if not ready or self._stopped.is_set():
                continue
            dead = sentinels[ready[0]]
            dead.join(0.1)
            msg = (f"TP rank process {dead.name} (pid {dead.pid}) exited with code "
                   f"{dead.exitcode}; stopping the engine")
            logger.error(msg)
            try:
                if self.on_death is not None:
                    self.on_death(msg)
            finally:
                for p in self.procs:
                    if p.is_alive():
                        p.kill()
                os._exit(1)
