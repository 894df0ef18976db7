"""Async facade over the engine process: ZMQ sockets, per-rid output queues, control calls,
the "last progress" heartbeat and engine liveness.

Sockets: the API process binds a PUSH socket at ``input_addr`` (requests, aborts, control) and a
PULL socket at ``output_addr`` (``ReadyMsg``/``StartupError``, ``BatchOutput``, ``ControlResp``).
Messages are pickled dataclasses (``engine.io_struct``). Unpickling is safe here only because the
peer is our own engine process on ``ipc://`` paths inside a private (0700) temp dir.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from engine.io_struct import (AbortReq, BatchOutput, ControlReq, ControlResp, GenerateReqInput,
                              ReadyMsg, ReqOutput, StartupError)
from engine.types import InvalidRequestError, SamplingParams

logger = logging.getLogger("server.engine_client")

HEALTH_CHECK_PREFIX = "HEALTH_CHECK"


class EngineUnavailableError(RuntimeError):
    """The engine process is dead, not started yet, or not reachable (HTTP 503)."""


class EngineStartupError(RuntimeError):
    """The engine failed to start (``StartupError`` or the process exited before ready)."""


class EngineClient:
    """Owns the engine-side sockets and the engine process handle.

    ``last_receive_tstamp`` (``time.time()`` seconds) is refreshed on every received message;
    ``stats`` holds the engine gauges of the latest ``BatchOutput``. Output queues are
    registered per rid; several rids may share one queue (a batch request). Each queue receives
    ``ReqOutput`` objects and, if the engine dies, one ``EngineUnavailableError`` instance.
    """

    def __init__(self, input_addr: str, output_addr: str, poll_interval: float = 0.2):
        self.input_addr, self.output_addr = input_addr, output_addr
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(input_addr)
        self._async_ctx = zmq.asyncio.Context()
        self._pull = self._async_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(output_addr)
        self._poll_interval = poll_interval
        self._queues: dict[str, asyncio.Queue] = {}
        self._control_futures: dict[int, asyncio.Future] = {}
        self._control_ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._ready: asyncio.Future | None = None
        self.proc: Any = None  # multiprocessing.Process of the engine
        self.ready_msg: ReadyMsg | None = None
        self.dead = False
        self.last_receive_tstamp = 0.0
        self.stats: dict[str, float] = {}
        self.weight_version: str | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def attach_process(self, proc: Any) -> None:
        """Remember the engine ``multiprocessing.Process`` so liveness can be watched."""
        self.proc = proc

    async def start(self) -> None:
        """Start the receive loop and the liveness watcher (call inside the event loop)."""
        self._ready = asyncio.get_running_loop().create_future()
        self._tasks = [asyncio.create_task(self._recv_loop()),
                       asyncio.create_task(self._watch_loop())]

    async def wait_ready(self) -> ReadyMsg:
        """Wait for ``ReadyMsg``. Raises ``EngineStartupError`` on ``StartupError`` or if the
        engine process exits first."""
        assert self._ready is not None, "start() first"
        return await asyncio.shield(self._ready)

    async def close(self) -> None:
        """Cancel the loops and close the sockets (the process is stopped by the launcher)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(EngineUnavailableError("server is shutting down"))
        self._push.close(0)
        self._pull.close(0)
        self._sync_ctx.term()
        self._async_ctx.term()

    @property
    def engine_alive(self) -> bool:
        """True while the engine process runs and has not been declared dead."""
        return not self.dead and self.proc is not None and self.proc.is_alive()

    @property
    def engine_pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def num_pending(self) -> int:
        """Requests (sequences) the API process is still waiting on."""
        return len(self._queues)

    # ---- sending --------------------------------------------------------------------------
    def _send(self, obj: Any) -> None:
        if not self.engine_alive:
            raise EngineUnavailableError("engine process is not running")
        try:
            self._push.send_pyobj(obj, flags=zmq.NOBLOCK)
        except zmq.Again as e:
            raise EngineUnavailableError("engine is not reachable") from e

    def in_flight(self, rid: str) -> bool:
        """True while a request with this rid is registered (sent and not yet released)."""
        return rid in self._queues

    def submit(self, req: GenerateReqInput, queue: asyncio.Queue) -> None:
        """Register ``queue`` for ``req.rid`` and send the request. Raises
        ``InvalidRequestError`` for a rid already in flight and ``EngineUnavailableError``
        (nothing stays registered then)."""
        if req.rid in self._queues:
            raise InvalidRequestError("rid", f"duplicate request id {req.rid!r}")
        self._queues[req.rid] = queue
        try:
            self._send(req)
        except EngineUnavailableError:
            self._queues.pop(req.rid, None)
            raise

    def release(self, rid: str) -> None:
        """Forget a rid's queue (later outputs for it are dropped)."""
        self._queues.pop(rid, None)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Ask the engine to abort requests whose rid starts with ``rid`` (or all). Never raises:
        a dead engine has nothing left to abort."""
        try:
            self._send(AbortReq(rid=rid, abort_all=abort_all))
        except EngineUnavailableError:
            pass

    def send_health_probe(self) -> str:
        """Send a 1-token greedy probe (``input_ids=[0]``, not counted as load). Its outputs are
        dropped; only the heartbeat matters. Returns the probe rid."""
        rid = f"{HEALTH_CHECK_PREFIX}_{time.time()}"
        sp = SamplingParams(max_new_tokens=1, temperature=0.0)
        self._send(GenerateReqInput(rid=rid, input_ids=[0], sampling_params=sp,
                                    log_metrics=False))
        return rid

    async def control(self, method: str, timeout: float = 30.0, **kwargs: Any) -> ControlResp:
        """Run a control method (``flush_cache``, ``get_internal_state``) in the engine between
        steps. Raises ``EngineUnavailableError`` if the engine is dead or does not answer
        within ``timeout`` seconds."""
        req_id = next(self._control_ids)
        fut = asyncio.get_running_loop().create_future()
        self._control_futures[req_id] = fut
        try:
            self._send(ControlReq(req_id=req_id, method=method, kwargs=kwargs))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as e:
            raise EngineUnavailableError(f"engine did not answer {method} in {timeout} s") from e
        finally:
            self._control_futures.pop(req_id, None)

    # ---- receiving ------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = await self._pull.recv_pyobj()
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken message must not stop the loop
                logger.exception("failed to receive an engine message")
                continue
            try:
                self._dispatch(msg)
            except Exception:
                logger.exception("failed to handle engine message %s", type(msg).__name__)
            self.last_receive_tstamp = time.time()

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchOutput):
            if msg.stats:
                self.stats = dict(msg.stats)
            for out in msg.outputs:
                self._route(out)
        elif isinstance(msg, ControlResp):
            fut = self._control_futures.get(msg.req_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, ReadyMsg):
            self.ready_msg = msg
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
        elif isinstance(msg, StartupError):
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(EngineStartupError(msg.message))
        else:
            logger.warning("unexpected engine message %r", type(msg).__name__)

    def _route(self, out: ReqOutput) -> None:
        if out.rid.startswith(HEALTH_CHECK_PREFIX):
            return
        if out.weight_version:
            self.weight_version = out.weight_version
        queue = self._queues.get(out.rid)
        if queue is not None:
            queue.put_nowait(out)
            if out.finished:
                self._queues.pop(out.rid, None)

    async def _watch_loop(self) -> None:
        while not self.dead:
            await asyncio.sleep(self._poll_interval)
            if self.proc is not None and not self.proc.is_alive():
                self.dead = True
                code = self.proc.exitcode
                logger.error("engine process %s exited (exit code %s)", self.proc.pid, code)
                err = EngineUnavailableError(f"engine process exited (exit code {code})")
                if self._ready is not None and not self._ready.done():
                    self._ready.set_exception(EngineStartupError(str(err)))
                self._fail_all(err)

    def _fail_all(self, err: Exception) -> None:
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(err)
        self._queues.clear()
        for fut in self._control_futures.values():
            if not fut.done():
                fut.set_exception(err)
