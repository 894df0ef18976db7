"""RL weight-update routes (sglang-facts.md sections 1.5, 1.6, 2): update from tensor / disk /
a trainer's process group, read back, weight version, pause and continue.

The API process never unpickles a payload: it only base64-decodes the per-rank entries and
forwards them in a ``ControlReq``; each engine rank opens its own entry through the allow-list
unpickler (``engine.weights.serialization``). Reader/writer semantics live in the engine: an
update waits, between steps, until in-flight requests finish (new ones are held meanwhile)
unless generation is paused. Answers are ``{success, message}`` with 200 or 400.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from engine.types import InvalidRequestError
from server.routes.common import get_state
from server.schemas import parse_body

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class UpdateFromTensorRequest(_Body):
    serialized_named_tensors: list[str]
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateFromDiskRequest(_Body):
    model_path: str
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitGroupRequest(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"


class DestroyGroupRequest(_Body):
    group_name: str = "weight_update_group"


class UpdateFromDistributedRequest(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None


class GetWeightsRequest(_Body):
    name: str
    truncate_size: int = 100
    tp_rank: int = 0


class UpdateVersionRequest(_Body):
    new_version: str
    abort_all_requests: bool = True


class PauseRequest(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra},
                        status_code=200 if success else 400)


async def _parse(model: type[BaseModel], request: Request, default_empty: bool = False):
    body = await request.body()
    if default_empty and not body.strip():
        body = b"{}"
    return parse_body(model, body)


async def _control(request: Request, method: str, abort_all: bool = False,
                   writer: bool = False, with_data: tuple[str, ...] = (),
                   **kwargs: Any) -> JSONResponse:
    """Run a weight control method on every engine rank. Writers may wait for in-flight
    requests, so they get no timeout (an engine death still fails them with 503).
    ``with_data``: keys of the engine's answer data copied into the JSON body."""
    state = get_state(request)
    if abort_all:
        state.client.abort(abort_all=True)
    resp = await state.client.control(method, timeout=None if writer else 120.0, **kwargs)
    if resp.success and kwargs.get("weight_version") is not None:
        state.client.weight_version = kwargs["weight_version"]
    data = resp.data if isinstance(resp.data, dict) else {}
    return _result(resp.success, resp.message, **{k: data[k] for k in with_data if k in data})


def _answers_invalid(route):
    """Turn an ``InvalidRequestError`` (a bad body) into SGLang's ``{success: false}`` 400,
    the envelope of every weight route."""
    @functools.wraps(route)
    async def wrapper(request: Request):
        try:
            return await route(request)
        except InvalidRequestError as e:
            return _result(False, str(e))
    return wrapper


@router.post("/update_weights_from_tensor")
@_answers_invalid
async def update_weights_from_tensor(request: Request) -> JSONResponse:
    body = await _parse(UpdateFromTensorRequest, request)
    tp = get_state(request).args.engine.tp_size
    if len(body.serialized_named_tensors) != tp:
        return _result(False, f"serialized_named_tensors: expected one entry per TP rank "
                              f"({tp}), got {len(body.serialized_named_tensors)}")
    entries = []
    for i, entry in enumerate(body.serialized_named_tensors):
        try:
            entries.append(base64.b64decode(entry, validate=True))
        except (binascii.Error, ValueError):
            return _result(False, f"serialized_named_tensors[{i}]: not valid base64")
    return await _control(request, "update_weights_from_tensor", body.abort_all_requests, True,
                          serialized_named_tensors=entries, load_format=body.load_format,
                          flush_cache=body.flush_cache, weight_version=body.weight_version)


@router.post("/update_weights_from_disk")
@_answers_invalid
async def update_weights_from_disk(request: Request) -> JSONResponse:
    body = await _parse(UpdateFromDiskRequest, request)
    resp = await _control(request, "update_weights_from_disk", body.abort_all_requests, True,
                          model_path=body.model_path, load_format=body.load_format,
                          flush_cache=body.flush_cache, weight_version=body.weight_version,
                          with_data=("num_paused_requests",))
    if resp.status_code == 200:  # /model_info and /v1/models now name the new checkpoint
        state = get_state(request)
        eng = state.args.engine
        new_eng = dataclasses.replace(eng, model_path=body.model_path,
                                      tokenizer_path=eng.resolved_tokenizer_path)
        state.args = dataclasses.replace(state.args, engine=new_eng)
    return resp


@router.post("/init_weights_update_group")
@_answers_invalid
async def init_weights_update_group(request: Request) -> JSONResponse:
    body = await _parse(InitGroupRequest, request)
    return await _control(request, "init_weights_update_group", writer=True,
                          **body.model_dump())


@router.post("/destroy_weights_update_group")
@_answers_invalid
async def destroy_weights_update_group(request: Request) -> JSONResponse:
    body = await _parse(DestroyGroupRequest, request, default_empty=True)
    return await _control(request, "destroy_weights_update_group", **body.model_dump())


@router.post("/update_weights_from_distributed")
@_answers_invalid
async def update_weights_from_distributed(request: Request) -> JSONResponse:
    body = await _parse(UpdateFromDistributedRequest, request)
    kwargs = body.model_dump(exclude={"abort_all_requests"})
    return await _control(request, "update_weights_from_distributed", body.abort_all_requests,
                          True, **kwargs)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request) -> Any:
    """The first ``truncate_size`` rows of rank ``tp_rank``'s shard (JSON nested list).
    Parameters come from the JSON body or, for a bodyless GET, the query string."""
    try:
        if (await request.body()).strip():
            body = await _parse(GetWeightsRequest, request)
        else:
            q = request.query_params
            body = GetWeightsRequest(name=q.get("name", ""),
                                     truncate_size=int(q.get("truncate_size", 100)),
                                     tp_rank=int(q.get("tp_rank", 0)))
    except (InvalidRequestError, ValueError) as e:
        return _result(False, str(e))
    tp = get_state(request).args.engine.tp_size
    if not 0 <= body.tp_rank < tp:
        return _result(False, f"tp_rank: {body.tp_rank} is outside [0, {tp})")
    if body.truncate_size < 1:
        return _result(False, f"truncate_size: must be >= 1, got {body.truncate_size}")
    resp = await get_state(request).client.control("get_weights_by_name", **body.model_dump())
    if not resp.success:
        return _result(False, resp.message)
    return JSONResponse(resp.data)


@router.post("/update_weight_version")
@_answers_invalid
async def update_weight_version(request: Request) -> JSONResponse:
    body = await _parse(UpdateVersionRequest, request)
    resp = await _control(request, "update_weight_version", body.abort_all_requests,
                          new_version=body.new_version)
    if resp.status_code == 200:
        get_state(request).client.weight_version = body.new_version
        return JSONResponse({"success": True, "message": "Weight version updated.",
                             "new_version": body.new_version})
    return resp


@router.post("/pause_generation")
@_answers_invalid
async def pause_generation(request: Request) -> JSONResponse:
    body = await _parse(PauseRequest, request, default_empty=True)
    state = get_state(request)
    resp = await state.client.control("pause_generation", mode=body.mode)
    if not resp.success:
        return _result(False, resp.message)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> JSONResponse:
    resp = await get_state(request).client.control("continue_generation")
    if not resp.success:
        return _result(False, resp.message)
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})
