"""``GET /metrics``: Prometheus text format from the server's own registry."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.routes.common import get_state

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Counters, latency histograms and the latest engine gauges (probes excluded)."""
    state = get_state(request)
    state.metrics.set_engine_stats(state.client.stats)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
