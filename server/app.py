"""``create_app``: the FastAPI app, its per-server state, start-up sequence and API-key check.

Start-up (runs in the background while uvicorn already answers, so probes see 503): wait for the
engine's ``ReadyMsg`` -> load the tokenizer -> one warm-up request (unless
``--skip-server-warmup``) -> reset the heartbeat (``last_receive_tstamp = time.time()``,
sglang-facts.md section 5.3) -> status UP and the ready log line.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.io_struct import GenerateReqInput
from engine.types import SamplingParams
from server.args import ServerArgs
from server.engine_client import EngineClient
from server.errors import install_error_handlers
from server.generation import GenerationService
from server.metrics import ServerMetrics

logger = logging.getLogger("server")

READY_LINE = "The server is fired up and ready to roll!"
WARMUP_TEXT = "The capital city of France is"


class ServerStatus(enum.Enum):
    STARTING = "starting"
    UP = "up"
    UNHEALTHY = "unhealthy"
    SHUTTING_DOWN = "shutting_down"


@dataclass
class ServerState:
    """Everything the routes share, stored on ``app.state.eyrie``.

    ``request_shutdown(exit_code)`` asks the launcher to stop the server (start-up failure).
    ``service`` is None until the engine is ready.
    """

    args: ServerArgs
    client: EngineClient
    metrics: ServerMetrics
    request_shutdown: Callable[[int], None] = lambda code: None
    status: ServerStatus = ServerStatus.STARTING
    service: GenerationService | None = None
    startup_task: asyncio.Task | None = None
    created: float = field(default_factory=time.time)
    model_card: dict[str, Any] = field(default_factory=lambda: {"model_type": None,
                                                                "architectures": None})

    @property
    def weight_version(self) -> str:
        return self.client.weight_version or self.args.engine.weight_version


def load_tokenizer_for(args: ServerArgs) -> Any:
    """Load the tokenizer named by ``--tokenizer-path`` (default: the model path)."""
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(args.engine.resolved_tokenizer_path)


def read_model_card(model_path: str) -> dict[str, Any]:
    """``model_type`` and ``architectures`` from ``config.json`` or GGUF metadata (None
    values when neither can be read)."""
    cfg: dict[str, Any] = {}
    try:
        config_json = os.path.join(model_path, "config.json")
        if os.path.isfile(config_json):
            with open(config_json) as f:
                cfg = json.load(f)
        else:
            from engine.weights.gguf_loader import find_gguf, gguf_to_hf_config

            gguf_path = find_gguf(model_path)
            cfg = gguf_to_hf_config(gguf_path) if gguf_path else {}
    except Exception as e:  # informational only
        logger.warning("could not read the model config of %s: %s", model_path, e)
    return {"model_type": cfg.get("model_type"), "architectures": cfg.get("architectures")}


async def startup_sequence(state: ServerState) -> None:
    """Bring the server from STARTING to UP; on failure log it and request shutdown (exit 1)."""
    args = state.args
    try:
        tok_task = asyncio.create_task(asyncio.to_thread(load_tokenizer_for, args))
        logger.info("waiting for the engine to load %s", args.engine.model_path)
        ready = await state.client.wait_ready()
        logger.info("engine ready: vocab %d, context %d tokens, KV capacity %d tokens",
                    ready.vocab_size, ready.context_len, ready.max_total_num_tokens)
        tokenizer = await tok_task
        state.model_card = await asyncio.to_thread(read_model_card, args.engine.model_path)
        logger.info("tokenizer loaded from %s", args.engine.resolved_tokenizer_path)
        state.service = GenerationService(state.client, tokenizer, ready, state.metrics)
        if not args.skip_server_warmup:
            await _warmup(state.service)
        # Heartbeat reset: liveness is measured from "ready", not from process start.
        state.client.last_receive_tstamp = time.time()
        state.status = ServerStatus.UP
        logger.info(READY_LINE)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        logger.error("server start-up failed: %s", e)
        state.request_shutdown(1)


async def _warmup(service: GenerationService) -> None:
    t0 = time.time()
    ids = service.check_prompt(service.encode(WARMUP_TEXT, "text"), "text")
    req = GenerateReqInput(rid=f"WARMUP_{time.time()}", input_ids=ids,
                           sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0),
                           log_metrics=False)
    async for st in service.run([req]):
        if st.finished:
            logger.info("warm-up done in %.2f s: %r", time.time() - t0, st.text)


class APIKeyMiddleware:
    """Pure ASGI check of ``Authorization: Bearer <key>`` (401 otherwise). Health and metrics
    probes are exempt, as in SGLang. Pure ASGI keeps streaming disconnects visible."""

    def __init__(self, app: Any, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope.get("path", "")
            if not (path.startswith("/health") or path.startswith("/metrics")):
                headers = dict(scope.get("headers") or [])
                auth = headers.get(b"authorization", b"").decode("latin-1")
                given = auth[7:] if auth.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                    body = {"error": {"message": "Unauthorized: missing or wrong API key"}}
                    if path.startswith("/v1"):
                        body = {"object": "error", "message": body["error"]["message"],
                                "type": "AuthenticationError", "param": None, "code": 401}
                    await JSONResponse(body, status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def create_app(args: ServerArgs, client: EngineClient,
               request_shutdown: Callable[[int], None] = lambda code: None) -> FastAPI:
    """Build the app around an ``EngineClient`` whose engine process is already starting."""
    from server.routes import admin, generate, health, metrics as metrics_routes, openai, weights

    state = ServerState(args=args, client=client, metrics=ServerMetrics(args.model_name),
                        request_shutdown=request_shutdown)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        state.startup_task = asyncio.create_task(startup_sequence(state))
        try:
            yield
        finally:
            state.status = ServerStatus.SHUTTING_DOWN
            state.startup_task.cancel()
            await asyncio.gather(state.startup_task, return_exceptions=True)
            await client.close()

    app = FastAPI(title="Eyrie", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.eyrie = state
    install_error_handlers(app)
    for module in (generate, openai, admin, health, metrics_routes, weights):
        app.include_router(module.router)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    return app
