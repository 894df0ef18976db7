"""``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI protocol, SGLang extras).

Errors use OpenAI's error object; ``param`` names the OpenAI field (``max_tokens``, ``n``,
``temperature``, ``prompt``, ``messages``...). An unknown ``model`` is 404.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.io_struct import GenerateReqInput
from engine.types import InvalidRequestError, SamplingParams
from server import openai_format as fmt
from server.engine_client import EngineUnavailableError
from server.errors import APIError
from server.generation import GenerationService, RequestFailed, SeqState
from server.routes.admin import accepted_model_names
from server.routes.common import SSE_DONE, SSEResponse, get_state, ready_service, sse
from server.schemas import ChatCompletionRequest, CompletionRequest, _OpenAIBase, parse_body

router = APIRouter()

# SGLang sampling field -> the OpenAI request field to name in errors
_OPENAI_FIELD = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                 "sampling_seed": "seed"}


def _sampling(service: GenerationService, body: _OpenAIBase, max_tokens: int | None
              ) -> SamplingParams:
    d = body.sampling_dict(max_tokens)
    d["n"] = body.n
    try:
        return service.sampling_params(d)
    except InvalidRequestError as e:
        name = e.field.removeprefix("sampling_params.")
        name = _OPENAI_FIELD.get(name, name)
        raise InvalidRequestError(name, str(e).split(": ", 1)[-1]) from None


def _check_model(request: Request, model: str | None) -> str:
    served = get_state(request).args.model_name
    if model is not None and model not in accepted_model_names(request):
        raise APIError(404, f"The model '{model}' does not exist", "model", "model_not_found")
    return served


def _expand(prompts: list[list[int]], sp: SamplingParams, rid: str, logprob: bool,
            top: int, stream: bool, prompt_logprobs: bool = False) -> list[GenerateReqInput]:
    n = sp.n
    single = len(prompts) * n == 1
    return [GenerateReqInput(rid=rid if single else f"{rid}_{i * n + j}", input_ids=ids,
                             sampling_params=sp.for_sample(j), return_logprob=logprob,
                             top_logprobs_num=top if logprob else 0, stream=stream,
                             logprob_start_len=0 if prompt_logprobs else -1)
            for i, ids in enumerate(prompts) for j in range(n)]


async def _collect(service: GenerationService, reqs: list[GenerateReqInput],
                   request: Request) -> list[SeqState]:
    final: list[Any] = [None] * len(reqs)
    async with aclosing(service.run(reqs, request, poll_disconnect=True)) as updates:
        async for st in updates:
            final[st.index] = st
    return final


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    """Text completion for a prompt (str, token ids) or a batch of them."""
    body = parse_body(CompletionRequest, await request.body())
    service = ready_service(request)
    model = _check_model(request, body.model)
    p = body.prompt
    if isinstance(p, str):  # tokenize off the event loop (long prompts take seconds)
        prompts = [await asyncio.to_thread(service.encode, p, "prompt")]
    elif not p:
        raise InvalidRequestError("prompt", "prompt is empty")
    elif isinstance(p[0], str):
        prompts = [await asyncio.to_thread(service.encode, t, "prompt") for t in p]
    elif isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = [list(x) for x in p]
    prompts = [service.check_prompt(ids, "prompt") for ids in prompts]
    sp = _sampling(service, body, body.max_tokens)
    if body.logprobs is not None and body.logprobs < 0:
        raise InvalidRequestError("logprobs", f"must be >= 0, got {body.logprobs}")
    if body.echo and body.stream:
        raise InvalidRequestError("echo", "echo with stream is not supported")
    rid = body.rid or service.new_rid()
    want_lp = body.logprobs is not None
    reqs = _expand(prompts, sp, rid, want_lp, body.logprobs or 0, body.stream,
                   prompt_logprobs=body.echo and want_lp)
    # echo: the prompt text leads each choice (as given, or decoded from token ids)
    echo = None
    if body.echo:
        echo = ([p] if isinstance(p, str) else list(p) if isinstance(p[0], str)
                else [service.tokenizer.decode(ids) for ids in prompts])
    oid, created = f"cmpl-{rid}", int(time.time())
    wv = get_state(request).weight_version
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return SSEResponse(_stream_completions(service, reqs, oid, created, model, want_lp,
                                               usage, sp.n))
    states = await _collect(service, reqs, request)
    return JSONResponse(fmt.completion_response(oid, created, model, states, sp.n,
                                                service.tokenizer, want_lp, wv, echo))


async def _stream_completions(service: GenerationService, reqs: list[GenerateReqInput],
                              oid: str, created: int, model: str, want_lp: bool,
                              include_usage: bool, n: int) -> AsyncIterator[bytes]:
    final: list[Any] = [None] * len(reqs)
    try:
        async with aclosing(service.run(reqs)) as updates:
            async for st in updates:
                final[st.index] = st
                if st.last_text_delta or st.finished:
                    yield sse(fmt.completion_chunk(oid, created, model, st, service.tokenizer,
                                                   want_lp))
        if include_usage:
            yield sse(fmt.usage_chunk(oid, created, model, "text_completion", final, n))
    except (InvalidRequestError, RequestFailed, EngineUnavailableError) as e:
        yield sse(_stream_error(e))
    yield SSE_DONE


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    """Chat completion: messages rendered with the model's chat template."""
    body = parse_body(ChatCompletionRequest, await request.body())
    service = ready_service(request)
    model = _check_model(request, body.model)
    if not body.messages:
        raise InvalidRequestError("messages", "must not be empty")
    from engine.tokenizer import apply_chat_template

    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = await asyncio.to_thread(apply_chat_template, service.tokenizer, messages)
    except Exception as e:
        raise InvalidRequestError("messages", f"chat template failed: {e}") from None
    ids = service.check_prompt(list(ids), "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is None:  # OpenAI: up to the context; the engine clamps to what fits
        max_tokens = max(1, service.ready.context_len - len(ids))
    sp = _sampling(service, body, max_tokens)
    top = body.top_logprobs or 0
    if top < 0 or (top and not body.logprobs):
        raise InvalidRequestError("top_logprobs", "must be >= 0 and needs logprobs=true")
    rid = body.rid or service.new_rid()
    reqs = _expand([ids], sp, rid, body.logprobs, top, body.stream)
    oid, created = f"chatcmpl-{rid}", int(time.time())
    wv = get_state(request).weight_version
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return SSEResponse(_stream_chat(service, reqs, oid, created, model, body.logprobs,
                                        usage, sp.n))
    states = await _collect(service, reqs, request)
    return JSONResponse(fmt.chat_response(oid, created, model, states, sp.n,
                                          service.tokenizer, body.logprobs, wv))


async def _stream_chat(service: GenerationService, reqs: list[GenerateReqInput], oid: str,
                       created: int, model: str, want_lp: bool, include_usage: bool,
                       n: int) -> AsyncIterator[bytes]:
    final: list[Any] = [None] * len(reqs)
    try:
        for i in range(len(reqs)):
            yield sse(fmt.chat_chunk(oid, created, model, i,
                                     {"role": "assistant", "content": ""}))
        async with aclosing(service.run(reqs)) as updates:
            async for st in updates:
                final[st.index] = st
                if not (st.last_text_delta or st.finished):
                    continue
                k = len(st.last_ids_delta)
                lp = None
                if want_lp and k:
                    tops = st.output_top_logprobs[-k:] if st.output_top_logprobs else []
                    lp = fmt.chat_logprobs(service.tokenizer, st.output_token_logprobs[-k:],
                                           tops)
                delta = {"content": st.last_text_delta} if st.last_text_delta else {}
                yield sse(fmt.chat_chunk(oid, created, model, st.index, delta,
                                         fmt.finish_reason(st), lp, fmt.matched_stop(st)))
        if include_usage:
            yield sse(fmt.usage_chunk(oid, created, model, "chat.completion.chunk", final, n))
    except (InvalidRequestError, RequestFailed, EngineUnavailableError) as e:
        yield sse(_stream_error(e))
    yield SSE_DONE


def _stream_error(e: Exception) -> dict[str, Any]:
    code = 400 if isinstance(e, InvalidRequestError) else getattr(e, "status_code", 503)
    return {"error": {"object": "error", "message": str(e), "type": "BadRequestError"
                      if code == 400 else "ServiceUnavailableError",
                      "param": getattr(e, "field", None), "code": code}}
