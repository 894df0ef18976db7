"""``GET /health`` (cheap liveness) and ``GET /health_generate`` (engine progress probe).

``/health_generate`` (sglang-facts.md section 1.3, ARCHITECTURE "Startup and health"): 503 while
starting or shutting down or once the engine process is gone; otherwise send a 1-token probe at
``tic = time.time()`` and answer 200 as soon as any engine message arrives after ``tic``
(checked every ``PROBE_POLL_S``), 503 after ``--health-check-timeout`` seconds. A busy engine
answers with the progress it makes anyway; an idle one runs the probe. Never a stale 200: only a
message received after this probe started counts.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.app import ServerStatus
from server.engine_client import EngineUnavailableError
from server.routes.common import get_state

router = APIRouter()
logger = logging.getLogger("server.health")

PROBE_POLL_S = 0.2


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when the server is up and the engine process is alive; 503 otherwise."""
    state = get_state(request)
    if state.status in (ServerStatus.STARTING, ServerStatus.SHUTTING_DOWN):
        return Response(status_code=503)
    return Response(status_code=200 if state.client.engine_alive else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 if the engine made progress within ``--health-check-timeout`` seconds of the probe."""
    state = get_state(request)
    client = state.client
    if state.status in (ServerStatus.STARTING, ServerStatus.SHUTTING_DOWN):
        return Response(status_code=503)
    if not client.engine_alive:
        return Response(status_code=503)
    tic = time.time()
    try:
        client.send_health_probe()
    except EngineUnavailableError:
        return Response(status_code=503)
    deadline = tic + state.args.health_check_timeout
    while time.time() < deadline:
        await asyncio.sleep(PROBE_POLL_S)
        if client.last_receive_tstamp > tic:
            if state.status == ServerStatus.UNHEALTHY:
                state.status = ServerStatus.UP
            return Response(status_code=200)
        if not client.engine_alive:
            return Response(status_code=503)
    logger.error("health check failed: no engine progress in %.1f s",
                 state.args.health_check_timeout)
    if state.status == ServerStatus.UP:
        state.status = ServerStatus.UNHEALTHY
    return Response(status_code=503)
