"""The engine process main loop (one per deployment TP rank; rank 0 talks to the API process).

    recv (GenerateReqInput | AbortReq | ControlReq) -> scheduler.step() -> send BatchOutput

Start-up order: load weights -> size KV -> warm up -> (test-only delay) -> ReadyMsg. The API
process resets its heartbeat when it sees ReadyMsg, so a long start-up never reads as a hang.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

import zmq

from engine.config import EngineArgs
from engine.distributed.parallel_state import ParallelState
from engine.engine import create_scheduler, warm_up
from engine.io_struct import (AbortReq, BatchOutput, ControlReq, ControlResp, GenerateReqInput,
                              ReadyMsg, StartupError)
from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger("engine.worker")

# Scheduler methods a ControlReq may call; each returns (success, message) or data.
CONTROL_METHODS = frozenset({"flush_cache", "get_internal_state"})


def handle_control(scheduler: Scheduler, req: ControlReq) -> ControlResp:
    if req.method not in CONTROL_METHODS:
        return ControlResp(req.req_id, False, f"unknown control method {req.method!r}")
    try:
        result = getattr(scheduler, req.method)(**req.kwargs)
    except Exception as e:  # a failed control call must not kill the engine
        logger.exception("control %s failed", req.method)
        return ControlResp(req.req_id, False, f"{type(e).__name__}: {e}")
    if isinstance(result, tuple):
        return ControlResp(req.req_id, bool(result[0]), str(result[1]))
    return ControlResp(req.req_id, True, "", result)


def dispatch(scheduler: Scheduler, msg, push: zmq.Socket) -> None:
    if isinstance(msg, GenerateReqInput):
        scheduler.add_request(msg)
    elif isinstance(msg, AbortReq):
        scheduler.abort(msg)
    elif isinstance(msg, ControlReq):
        push.send_pyobj(handle_control(scheduler, msg))
    else:
        logger.warning("ignoring unknown message %r", type(msg).__name__)


def run_engine(args: EngineArgs, input_addr: str, output_addr: str,
               log_level: str = "info") -> None:
    """Process entry point. Exits when the parent process goes away."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s [engine] %(levelname)s %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(output_addr)
    try:
        scheduler = create_scheduler(args, ParallelState())
        if not args.skip_warmup:
            t0 = time.time()
            warm_up(scheduler)
            logger.info("warm-up done in %.2f s", time.time() - t0)
        if args.debug_startup_delay > 0:
            logger.info("test-only start-up delay of %.1f s", args.debug_startup_delay)
            time.sleep(args.debug_startup_delay)
        push.send_pyobj(ReadyMsg(scheduler.allocator.capacity_tokens,
                                 scheduler.max_req_input_len, scheduler.context_len,
                                 scheduler.vocab_size))
    except Exception as e:
        push.send_pyobj(StartupError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        time.sleep(0.5)  # let the message leave before the process exits
        raise
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while True:
        timeout = 0 if scheduler.busy else 200
        if poller.poll(timeout):
            while True:
                try:
                    dispatch(scheduler, pull.recv_pyobj(zmq.NOBLOCK), push)
                except zmq.Again:
                    break
        elif not scheduler.busy and os.getppid() != parent:
            logger.info("parent process gone; exiting")
            return
        outs = scheduler.step()
        if outs or scheduler.health_pending:
            scheduler.health_pending = False
            state = scheduler.get_internal_state()
            push.send_pyobj(BatchOutput(outs, stats={
                k: state[k] for k in ("num_running_reqs", "num_waiting_reqs", "kv_used_tokens",
                                      "kv_total_tokens", "cache_hit_tokens", "prompt_tokens")}))
