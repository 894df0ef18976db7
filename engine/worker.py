"""The engine process main loop: one process per deployment TP rank; rank 0 talks to the API.

    rank 0:    recv (GenerateReqInput | AbortReq | ControlReq) -> broadcast -> step -> send
    rank k>0:  receive the broadcast -> step

Tensor parallelism, lockstep by identical inputs: rank 0 broadcasts the messages it received in
each loop iteration (``broadcast_object_list`` over the gloo CPU group, SGLang's
``broadcast_pyobj``) and every rank feeds them to its own scheduler. The schedulers are
deterministic (no clocks, no ``id()``-ordered choices, identical KV capacity from an all-reduce
MIN) and sampling is identical on every rank (greedy is; random draws use one seed shared by all
ranks), so every rank builds the same batch without shipping batches around: one small
broadcast per step, and the scheduler stays a single-process object that tests drive directly.
Control calls run on every rank; rank 0 merges the answers. Only rank 0 sends outputs.

Start-up order: dist init -> load weights -> size KV -> warm up -> (test-only delay) -> barrier ->
ReadyMsg. The API process resets its heartbeat on ReadyMsg, so a long start-up never reads as a
hang. Each node's leader (started by that node's server; rank 0 on node 0) spawns the other ranks
of its node; see ``engine.distributed.launch`` for the rank layout, process groups and the
lifecycle guarantees (multi-node included).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import sys
import time
import traceback
from typing import Any, Callable

import zmq

from engine.config import EngineArgs
from engine.distributed import launch
from engine.distributed.parallel_state import ParallelState
from engine.engine import create_scheduler, warm_up
from engine.io_struct import (AbortReq, BatchOutput, ControlReq, ControlResp, GenerateReqInput,
                              ReadyMsg, StartupError)
from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger("engine.worker")

# Scheduler methods a ControlReq may call; each returns (success, message) or data.
CONTROL_METHODS = frozenset({"flush_cache", "get_internal_state", "pause_generation",
                             "continue_generation"})
# engine.weights.updater.WeightUpdater methods (``scheduler.weights``); the writers among them
# wait for in-flight requests unless paused, while newly arrived requests are held
WEIGHT_METHODS = frozenset({"update_weights_from_tensor", "update_weights_from_disk",
                            "update_weights_from_distributed", "init_weights_update_group",
                            "destroy_weights_update_group", "get_weights_by_name",
                            "update_weight_version"})
WEIGHT_WRITERS = frozenset({"update_weights_from_tensor", "update_weights_from_disk",
                            "update_weights_from_distributed"})
IDLE_POLL_MS = 200  # how long an idle rank 0 waits for input before the next (empty) round
STATS_KEYS = ("num_running_reqs", "num_waiting_reqs", "kv_used_tokens", "kv_total_tokens",
              "cache_hit_tokens", "prompt_tokens")


def handle_control(scheduler: Scheduler, req: ControlReq) -> ControlResp:
    if req.method not in CONTROL_METHODS | WEIGHT_METHODS:
        return ControlResp(req.req_id, False, f"unknown control method {req.method!r}")
    try:
        target = scheduler.weights if req.method in WEIGHT_METHODS else scheduler
        result = getattr(target, req.method)(**req.kwargs)
    except Exception as e:  # a failed control call must not kill the engine
        logger.exception("control %s failed", req.method)
        why = e.args[0] if isinstance(e, KeyError) and e.args else e  # no repr quotes
        return ControlResp(req.req_id, False, f"{type(e).__name__}: {why}")
    if isinstance(result, tuple):  # (success, message) or (success, message, data)
        return ControlResp(req.req_id, bool(result[0]), str(result[1]),
                           result[2] if len(result) > 2 else None)
    return ControlResp(req.req_id, True, "", result)


def merge_control(resps: list[ControlResp]) -> ControlResp:
    """One answer from every rank's answer (index = tp_rank): success only if all succeeded;
    the distinct messages joined with " | " (identical ones once, so tp=2 reads like tp=1);
    ``data`` from rank 0 (the schedulers are identical)."""
    messages = list(dict.fromkeys(r.message for r in resps if r.message))
    return ControlResp(resps[0].req_id, all(r.success for r in resps), " | ".join(messages),
                       next((r.data for r in resps if r.data is not None), None))


class ApiIO:
    """Rank 0's ZMQ sockets: PULL requests from ``input_addr``, PUSH outputs to
    ``output_addr`` (the API process binds both)."""

    def __init__(self, input_addr: str, output_addr: str):
        self.output_addr = output_addr
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(input_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.ready = False

    def recv_all(self, timeout_ms: int) -> list[Any]:
        """Every queued message, waiting up to ``timeout_ms`` for the first."""
        msgs: list[Any] = []
        if self.poller.poll(timeout_ms):
            while True:
                try:
                    msgs.append(self.pull.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return msgs

    def send(self, obj: Any) -> None:
        self.push.send_pyobj(obj)

    def send_from_thread(self, obj: Any) -> None:
        """Send on a fresh socket (sockets are not thread-safe); waits up to 1 s for delivery."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(self.output_addr)
        sock.send_pyobj(obj)
        sock.close(linger=1000)

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=500)
        self.ctx.term()


def start_scheduler(args: EngineArgs, ps: ParallelState, io: ApiIO | None) -> Scheduler:
    """Build and warm up this rank's scheduler; rank 0 then sends ReadyMsg. At tp > 1 the
    sampler seed is rank 0's (``--random-seed`` or a fresh random one) on every rank."""
    if ps.tp_size > 1:
        seed = args.random_seed if args.random_seed is not None else secrets.randbits(31)
        args = dataclasses.replace(args, random_seed=ps.broadcast_object(seed))
    scheduler = create_scheduler(args, ps)
    if not args.skip_warmup:
        t0 = time.time()
        warm_up(scheduler)
        logger.info("warm-up done in %.2f s", time.time() - t0)
    if args.debug_startup_delay > 0 and io is not None:
        logger.info("test-only start-up delay of %.1f s", args.debug_startup_delay)
        time.sleep(args.debug_startup_delay)
    ps.barrier()
    if io is not None:
        io.send(ReadyMsg(scheduler.allocator.capacity_tokens, scheduler.max_req_input_len,
                         scheduler.context_len, scheduler.vocab_size))
        io.ready = True
    return scheduler


def serve(scheduler: Scheduler, ps: ParallelState, io: ApiIO | None, parent_pid: int,
          before_stop: Callable[[], None] | None = None,
          should_stop: Callable[[], bool] = lambda: False) -> None:
    """The loop, on every rank. Returns on every rank (all nodes) when rank 0 decides to stop:
    its parent (the API process) is gone and the engine is idle, or ``should_stop()`` (a
    SIGTERM); rank 0 calls ``before_stop`` first (so exiting peers are expected). Raises
    RuntimeError from gloo when a peer rank (any node) dies mid-collective."""
    deferred: list[ControlReq] = []  # weight updates waiting for in-flight requests
    while True:
        msgs, stop = [], False
        if io is not None:
            msgs = io.recv_all(0 if scheduler.busy and not scheduler.paused else IDLE_POLL_MS)
            orphaned = not msgs and (not scheduler.busy or scheduler.paused) and \
                os.getppid() != parent_pid  # paused requests would never finish
            stop = orphaned or should_stop()
            if stop:
                logger.info("%s; stopping every TP rank", "parent process gone" if orphaned
                            else "stop requested")
                if before_stop is not None:
                    before_stop()
        msgs, stop = ps.broadcast_object((msgs, stop))
        if stop:
            return
        resps = []
        for msg in msgs:
            if isinstance(msg, GenerateReqInput):
                scheduler.add_request(msg)
            elif isinstance(msg, AbortReq):
                scheduler.abort(msg)
            elif isinstance(msg, ControlReq) and msg.method in WEIGHT_WRITERS and (
                    deferred or not scheduler.can_update_weights):
                deferred.append(msg)  # runs once in-flight requests are done (or paused)
                scheduler.hold_new = True
            elif isinstance(msg, ControlReq):
                resps.append(handle_control(scheduler, msg))
            else:
                logger.warning("ignoring unknown message %r", type(msg).__name__)
        while deferred and scheduler.can_update_weights:
            resps.append(handle_control(scheduler, deferred.pop(0)))
        if not deferred and scheduler.hold_new:
            scheduler.release_held()
        if resps:
            per_rank = ps.gather_objects(resps)
            if io is not None:
                for answers in zip(*per_rank):
                    io.send(merge_control(list(answers)))
        outs = scheduler.step()
        if outs or scheduler.health_pending:
            scheduler.health_pending = False
            if io is not None:
                state = scheduler.get_internal_state()
                io.send(BatchOutput(outs, stats={k: state[k] for k in STATS_KEYS}))


def run_engine(args: EngineArgs, input_addr: str | None, output_addr: str | None,
               log_level: str = "info") -> None:
    """Process entry point of a node leader: global rank 0 on node 0, rank k * per_node on
    node k (the server starts it on every node).

    Spawns this node's other TP ranks and talks ZMQ to the API process (node 0 only; other
    nodes pass None addresses). Exits when its parent goes away (node 0: once idle, stopping
    every rank on every node; node k > 0: at once, by SIGKILL), on SIGTERM/SIGINT (see
    ``launch.StopOnSignal``), or as soon as any of its ranks or any other node dies; its ranks
    never outlive it. Start-up failures (any rank, any node) reach node 0's API process as
    ``StartupError``; elsewhere they raise (exit code 1). Must not run in a daemonic process.
    """
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s [engine] %(levelname)s %(message)s")
    parent = os.getppid()
    if args.node_rank > 0:
        launch.die_with_parent(parent)  # it cannot stop the other nodes; they see it go
    stopper = launch.StopOnSignal(is_rank0=args.node_rank == 0).install()
    io = ApiIO(input_addr, output_addr) if args.node_rank == 0 else None
    procs: list = []
    watchdog = None
    clean = False
    try:
        try:
            layout = launch.RankLayout.from_args(args)
            rank, ps = layout.leader_rank, ParallelState()
            if args.tp_size > 1:
                launch.limit_threads(layout.per_node)
                store, addr = launch.create_store(args.dist_init_addr, rank, args.tp_size)
                procs = launch.spawn_ranks(run_rank, list(range(rank + 1, rank + layout.per_node)),
                                           args, addr, log_level)
                on_death = None
                if io is not None:
                    def on_death(msg: str) -> None:
                        if not io.ready:
                            io.send_from_thread(StartupError(msg))
                watchdog = launch.RankWatchdog(procs, on_death).start()
                logger.info("TP %d, node %d of %d: ranks %d..%d here (spawned pids %s), "
                            "process group at %s", args.tp_size, args.node_rank, args.nnodes,
                            rank, rank + layout.per_node - 1, [p.pid for p in procs], addr)
                ps = launch.init_parallel_state(store, rank, args.tp_size,
                                                args.resolved_device, args.nnodes)
            scheduler = start_scheduler(args, ps, io)
        except Exception as e:
            if io is not None:
                io.send(StartupError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
                time.sleep(0.5)  # let the message leave before the process exits
            raise
        if io is None:
            logger.info("node %d of %d: TP ranks %d..%d ready, serving node 0's requests",
                        args.node_rank, args.nnodes, rank, rank + layout.per_node - 1)
        stopper.serving = True
        serve(scheduler, ps, io, parent, before_stop=watchdog.stop if watchdog else None,
              should_stop=lambda: stopper.requested)
        if io is None:
            logger.info("node 0 stopped the deployment; exiting")
        clean = True
    finally:
        if watchdog is not None:
            watchdog.stop()
        launch.stop_ranks(procs, timeout=3.0 if clean else 0.5)
        if io is not None:
            io.close()


def run_rank(args: EngineArgs, rank: int, dist_init_addr: str, log_level: str = "info",
             parent_pid: int | None = None) -> None:
    """Process entry point of TP rank ``rank`` (not a node leader), spawned by its leader.

    Dies with its leader (SIGKILL via PR_SET_PDEATHSIG) and ignores SIGINT, so Ctrl-C and
    SIGTERM are handled once, by the leader. Raises (exit code 1) on any start-up error; the
    leader's watchdog turns that into a StartupError for the API process.
    """
    if parent_pid is not None:
        launch.die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level = log_level.upper() if log_level.lower() == "debug" else "WARNING"
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s [engine tp{rank}] %(levelname)s %(message)s")
    layout = launch.RankLayout.from_args(args)
    launch.limit_threads(layout.per_node)
    store, _ = launch.create_store(dist_init_addr, rank, args.tp_size)
    ps = launch.init_parallel_state(store, rank, args.tp_size, args.resolved_device,
                                    args.nnodes)
    scheduler = start_scheduler(args, ps, None)
    serve(scheduler, ps, None, parent_pid or os.getppid())
