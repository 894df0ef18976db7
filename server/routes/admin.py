"""Info and control routes: ``/model_info``, ``/server_info``, ``/weight_version`` (each with
its deprecated ``/get_*`` alias), ``/flush_cache``, ``/abort_request`` and ``/v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.engine_client import EngineUnavailableError
from server.errors import APIError
from server.routes.common import get_state
from server.schemas import AbortRequest, parse_body

router = APIRouter()

FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n")


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    state = get_state(request)
    eng = state.args.engine
    return {"model_path": eng.model_path, "tokenizer_path": eng.resolved_tokenizer_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": state.weight_version, "has_image_understanding": False,
            "has_audio_understanding": False, **state.model_card}


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    """All flags, the engine's ``get_internal_state`` (one dict per engine; empty while the
    engine is starting or dead), the engine pid and API-side counters."""
    state = get_state(request)
    internal: list[dict[str, Any]] = []
    if state.client.ready_msg is not None and state.client.engine_alive:
        try:
            resp = await state.client.control("get_internal_state", timeout=10.0)
            if resp.success and isinstance(resp.data, dict):
                internal.append(resp.data)
        except EngineUnavailableError:
            pass
    ready = state.client.ready_msg
    return {**state.args.to_info_dict(), "internal_states": internal, "version": _version(),
            "status": (state.status.value if state.client.engine_alive
                       or state.client.ready_msg is None else "unhealthy"),
            "engine_pid": state.client.engine_pid,
            "engine_alive": state.client.engine_alive,
            "num_pending_requests": state.client.num_pending,
            "max_total_num_tokens": ready.max_total_num_tokens if ready else None,
            "max_req_input_len": ready.max_req_input_len if ready else None,
            "weight_version": state.weight_version}


@router.get("/weight_version")
@router.get("/get_weight_version")
async def weight_version(request: Request) -> dict[str, str]:
    return {"weight_version": get_state(request).weight_version}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """200 when the engine flushed its prefix cache; 400 with the engine's message while
    requests are running or waiting; 503 if the engine is not running."""
    resp = await get_state(request).client.control("flush_cache")
    if resp.success:
        return Response(FLUSH_OK, media_type="text/plain")
    return JSONResponse({"error": {"message": resp.message or "cache not flushed"}},
                        status_code=400)


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """Abort requests whose rid starts with ``rid`` (or all with ``abort_all``); 200 empty."""
    body = parse_body(AbortRequest, await request.body())
    if not body.rid and not body.abort_all:
        raise APIError(400, "rid: give a rid or abort_all=true", "rid")
    get_state(request).client.abort(body.rid, body.abort_all)
    return Response(status_code=200)


def model_card(request: Request) -> dict[str, Any]:
    state = get_state(request)
    ready = state.client.ready_msg
    return {"id": state.args.model_name, "object": "model", "created": int(state.created),
            "owned_by": "sglang", "root": state.args.model_name, "parent": None,
            "max_model_len": ready.context_len if ready else state.args.engine.context_length}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(request)]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    if model not in accepted_model_names(request):
        raise APIError(404, f"The model '{model}' does not exist", "model", "model_not_found")
    return model_card(request)


def accepted_model_names(request: Request) -> set[str]:
    """Names a ``/v1`` request may use: the served name, the model path, and "default"."""
    args = get_state(request).args
    return {args.model_name, args.engine.model_path, "default"}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("eyrie")
    except Exception:
        return "0.0.0+local"
