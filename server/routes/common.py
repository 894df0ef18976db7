"""Helpers shared by the route modules: state access and SSE framing."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from server.app import ServerState, ServerStatus
from server.engine_client import EngineUnavailableError
from server.generation import GenerationService


def get_state(request: Request) -> ServerState:
    return request.app.state.eyrie


def ready_service(request: Request) -> GenerationService:
    """The generation service, or ``EngineUnavailableError`` (503) while starting, shutting down
    or after the engine died."""
    state = get_state(request)
    if state.status == ServerStatus.STARTING or state.service is None:
        raise EngineUnavailableError("server is starting; retry when /health_generate is 200")
    if state.status == ServerStatus.SHUTTING_DOWN:
        raise EngineUnavailableError("server is shutting down")
    if not state.client.engine_alive:
        raise EngineUnavailableError("engine process is not running")
    return state.service


def sse(obj: Any) -> bytes:
    """One server-sent event frame ``data: <json>\\n\\n`` (orjson: UTF-8, ~7x faster than
    ``json`` on a typical frame; every streamed token of every request goes through here)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that watches for the client's disconnect while streaming
    and always closes its body iterator (so the generator's ``finally`` aborts unfinished
    requests at once, not when the generator is garbage-collected)."""

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.create_task(watch_disconnect())
        streamer = asyncio.create_task(self.stream_response(send))
        try:
            await asyncio.wait({watcher, streamer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watcher, streamer):
                task.cancel()
            await asyncio.gather(watcher, streamer, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
