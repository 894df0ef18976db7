"""``POST|PUT /generate``: SGLang's native generation route (sglang-facts.md section 1.2).

A single prompt answers one object; a batch (list ``text`` / list-of-lists ``input_ids``) or
``n > 1`` answers a list, one object per sequence. Streaming sends cumulative ``text`` and
``output_ids`` as SSE frames, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio

from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.io_struct import GenerateReqInput
from engine.types import InvalidRequestError
from server.engine_client import EngineUnavailableError
from server.generation import GenerationService, RequestFailed, SeqState
from server.routes.common import SSE_DONE, SSEResponse, ready_service, sse
from server.schemas import GenerateRequest, parse_body

router = APIRouter()


def _per_prompt(value: Any, i: int, num: int, name: str, default: Any) -> Any:
    """A per-prompt field given once (shared) or as a list with one entry per prompt."""
    if value is None:
        return default
    if isinstance(value, list):
        if len(value) != num:
            raise InvalidRequestError(name, f"has {len(value)} entries for {num} prompts")
        return value[i] if value[i] is not None else default
    return value


def build_requests(service: GenerationService, body: GenerateRequest
                   ) -> tuple[list[GenerateReqInput], bool]:
    """Expand a ``/generate`` body into one ``GenerateReqInput`` per sequence.

    Returns ``(requests, is_batch)``. Batch rids are ``f"{rid}_{i}"`` (SGLang's scheme).
    Raises ``InvalidRequestError`` naming the field for any bad input.
    """
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError("text", "exactly one of text or input_ids must be provided")
    if body.text is not None:
        is_batch = isinstance(body.text, list)
        texts = body.text if is_batch else [body.text]
        if not texts:
            raise InvalidRequestError("text", "batch is empty")
        prompts = [service.check_prompt(service.encode(t, "text"), "text") for t in texts]
    else:
        ids = body.input_ids
        is_batch = bool(ids) and isinstance(ids[0], list)
        batch = ids if is_batch else [ids]
        prompts = [service.check_prompt(list(p), "input_ids") for p in batch]
    num = len(prompts)
    if isinstance(body.sampling_params, list) and not is_batch and len(body.sampling_params) == 1:
        body = body.model_copy(update={"sampling_params": body.sampling_params[0]})
    params = [service.sampling_params(_per_prompt(body.sampling_params, i, num,
                                                  "sampling_params", {})) for i in range(num)]
    n = params[0].n
    if any(p.n != n for p in params):
        raise InvalidRequestError("sampling_params.n", "must be the same for every prompt")
    expand = is_batch or n > 1
    base = body.rid if isinstance(body.rid, str) else None
    if isinstance(body.rid, list) and len(body.rid) != num:
        raise InvalidRequestError("rid", f"has {len(body.rid)} entries for {num} prompts")
    base = base or service.new_rid()
    reqs: list[GenerateReqInput] = []
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        top = _per_prompt(body.top_logprobs_num, i, num, "top_logprobs_num", 0)
        start = _per_prompt(body.logprob_start_len, i, num, "logprob_start_len", -1)
        want = bool(_per_prompt(body.return_logprob, i, num, "return_logprob", False))
        if top < 0:
            raise InvalidRequestError("top_logprobs_num", f"must be >= 0, got {top}")
        if start < -1 or start >= len(ids):
            raise InvalidRequestError("logprob_start_len",
                                      f"must be -1 or in [0, {len(ids)}), got {start}")
        for j in range(n):
            if isinstance(body.rid, list):
                rid = body.rid[i] if n == 1 else f"{body.rid[i]}_{j}"
            else:
                rid = f"{base}_{len(reqs)}" if expand else base
            reqs.append(GenerateReqInput(
                rid=rid, input_ids=ids, sampling_params=sp.for_sample(j),
                return_logprob=want, top_logprobs_num=top if want else 0,
                logprob_start_len=start, stream=body.stream))
    seen: set[str] = set()
    for r in reqs:
        if r.rid in seen or service.client.in_flight(r.rid):
            raise InvalidRequestError("rid", f"duplicate request id {r.rid!r} (ids must be "
                                      "unique among requests in flight)")
        seen.add(r.rid)
    return reqs, expand


def _logprob_triples(service: GenerationService, pairs: list, with_text: bool) -> list:
    # SGLang reports None as the logprob of the first prompt token (nothing predicts it)
    return [[None if lp is None else float(lp), int(tid),
             service.tokenizer.decode([tid]) if with_text else None] for lp, tid in pairs]


def format_item(service: GenerationService, st: SeqState, req: GenerateReqInput,
                with_text: bool) -> dict[str, Any]:
    """SGLang's response object: ``text``, ``output_ids`` and ``meta_info``."""
    meta: dict[str, Any] = {
        "id": st.rid, "finish_reason": st.finish_reason, "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens, "cached_tokens": st.cached_tokens,
        "weight_version": st.weight_version, "total_retractions": st.total_retractions,
    }
    if st.finished:
        meta["e2e_latency"] = st.e2e_latency
    if req.return_logprob:
        meta["output_token_logprobs"] = _logprob_triples(service, st.output_token_logprobs,
                                                         with_text)
        if req.logprob_start_len >= 0:
            meta["input_token_logprobs"] = _logprob_triples(service, st.input_token_logprobs,
                                                            with_text)
        if req.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_logprob_triples(service, pos, with_text)
                                           for pos in st.output_top_logprobs]
            if req.logprob_start_len >= 0:
                meta["input_top_logprobs"] = [_logprob_triples(service, pos, with_text)
                                              for pos in st.input_top_logprobs]
    return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Any:
    """Generate for one prompt or a batch; see the module docstring. 400 on bad input (naming
    the field), 503 while starting or if the engine died."""
    body = parse_body(GenerateRequest, await request.body())
    service = ready_service(request)
    # tokenizing a long prompt takes seconds: off the event loop, so health probes still answer
    reqs, is_batch = await asyncio.to_thread(build_requests, service, body)
    with_text = body.return_text_in_logprobs
    if body.stream:
        return SSEResponse(_stream(service, reqs, is_batch, with_text))
    final: list[SeqState | None] = [None] * len(reqs)
    async with aclosing(service.run(reqs, request, poll_disconnect=True)) as updates:
        async for st in updates:
            final[st.index] = st
    items = [format_item(service, st, req, with_text) for st, req in zip(final, reqs)]
    return JSONResponse(items if is_batch else items[0])


async def _stream(service: GenerationService, reqs: list[GenerateReqInput], is_batch: bool,
                  with_text: bool) -> AsyncIterator[bytes]:
    try:
        async with aclosing(service.run(reqs)) as updates:
            async for st in updates:
                item = format_item(service, st, reqs[st.index], with_text)
                if is_batch:
                    item["index"] = st.index
                yield sse(item)
    except (InvalidRequestError, RequestFailed, EngineUnavailableError) as e:
        yield sse({"error": {"message": str(e)}})
    yield SSE_DONE
