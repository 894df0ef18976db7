"""The request path shared by ``/generate`` and the OpenAI routes: tokenize, validate, send one
``GenerateReqInput`` per sequence, and follow the engine's deltas into cumulative per-sequence
state (``SeqState``), recording metrics and aborting sequences whose client went away.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine.io_struct import GenerateReqInput, ReadyMsg, ReqOutput
from engine.types import InvalidRequestError, SamplingParams
from server.engine_client import EngineClient, EngineUnavailableError
from server.metrics import ServerMetrics

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks its client (seconds)


class ClientDisconnected(Exception):
    """The HTTP client went away; its sequences were aborted."""


class RequestFailed(Exception):
    """The engine ended a request with an error status (``status_code`` is an HTTP status)."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code


@dataclass
class SeqState:
    """Cumulative state of one sequence. Times are ``time.time()`` seconds. Logprob lists hold
    ``(logprob, token_id)`` pairs; top lists one list of pairs per position."""

    rid: str
    index: int
    prompt_tokens: int
    created: float = field(default_factory=time.time)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    finished: bool = False
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str = "default"
    total_retractions: int = 0
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # the delta of the latest update (what a streaming OpenAI chunk carries)
    last_text_delta: str = ""
    last_ids_delta: list[int] = field(default_factory=list)

    @property
    def e2e_latency(self) -> float:
        return (self.finished_time or time.time()) - self.created

    def apply(self, out: ReqOutput) -> None:
        """Fold one engine delta into the cumulative state."""
        now = time.time()
        if out.new_output_ids and self.first_token_time is None:
            self.first_token_time = now
        # the engine holds back possible stop-string prefixes, so deltas are final text
        self.text += out.new_text
        self.last_text_delta = out.new_text
        self.output_ids.extend(out.new_output_ids)
        self.last_ids_delta = list(out.new_output_ids)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.weight_version = out.weight_version
        self.total_retractions = out.total_retractions
        self.output_token_logprobs.extend(out.output_token_logprobs)
        self.output_top_logprobs.extend(out.output_top_logprobs)
        self.input_token_logprobs.extend(out.input_token_logprobs)
        self.input_top_logprobs.extend(out.input_top_logprobs)
        if out.finished:
            self.finished, self.finish_reason, self.finished_time = True, out.finish_reason, now


class GenerationService:
    """Validation and the engine round trip. Built once the engine is ready.

    ``tokenizer`` is the object from ``engine.tokenizer.load_tokenizer``; ``ready`` gives the
    vocabulary size and the prompt limit (``max_req_input_len`` tokens).
    """

    def __init__(self, client: EngineClient, tokenizer: Any, ready: ReadyMsg,
                 metrics: ServerMetrics | None):
        self.client, self.tokenizer, self.ready, self.metrics = client, tokenizer, ready, metrics

    # ---- input checks ---------------------------------------------------------------------
    def encode(self, text: str, field_name: str) -> list[int]:
        """Tokenize ``text`` (special tokens such as BOS added, as SGLang does). Raises
        ``InvalidRequestError`` for an empty prompt."""
        if not text:
            raise InvalidRequestError(field_name, "prompt is empty")
        return list(self.tokenizer.encode(text))

    def check_prompt(self, ids: list[int], field_name: str) -> list[int]:
        """Check a tokenized prompt: non-empty, ids inside the vocabulary, at most
        ``max_req_input_len`` tokens. Raises ``InvalidRequestError`` naming ``field_name``."""
        if not ids:
            raise InvalidRequestError(field_name, "prompt is empty")
        vocab = self.ready.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise InvalidRequestError(field_name, f"token id {t} is outside the "
                                          f"vocabulary [0, {vocab})")
        limit = self.ready.max_req_input_len
        if len(ids) > limit:
            raise InvalidRequestError(field_name, f"prompt has {len(ids)} tokens, longer than "
                                      f"the limit of {limit} tokens (context length "
                                      f"{self.ready.context_len})")
        return ids

    def sampling_params(self, d: dict[str, Any] | None) -> SamplingParams:
        """``SamplingParams`` from a JSON dict, range-checked. Raises ``InvalidRequestError``."""
        try:
            sp = SamplingParams.from_dict(d)
        except TypeError as e:  # defensive: from_dict passes keys through to the dataclass
            raise InvalidRequestError("sampling_params", str(e)) from None
        sp.validate(self.ready.vocab_size)
        return sp

    @staticmethod
    def new_rid() -> str:
        return uuid.uuid4().hex

    # ---- engine round trip ----------------------------------------------------------------
    async def run(self, reqs: list[GenerateReqInput], request: Any = None,
                  poll_disconnect: bool = False) -> AsyncIterator[SeqState]:
        """Send ``reqs`` and yield the updated ``SeqState`` after every delta until all have
        finished (``SeqState.index`` is the position in ``reqs``).

        Raises ``EngineUnavailableError`` (engine dead: 503), ``InvalidRequestError`` (engine
        rejected the input: 400), ``RequestFailed`` (aborted with a 4xx/5xx status) and
        ``ClientDisconnected`` (only with ``poll_disconnect``, which checks the client every
        ``DISCONNECT_POLL_S`` seconds). Unfinished sequences are aborted when the iterator is
        closed early, cancelled or fails.
        """
        queue: asyncio.Queue = asyncio.Queue()
        states = {r.rid: SeqState(rid=r.rid, index=i, prompt_tokens=len(r.input_ids))
                  for i, r in enumerate(reqs)}
        log = self.metrics if all(r.log_metrics for r in reqs) else None
        submitted: list[str] = []
        try:
            for r in reqs:
                self.client.submit(r, queue)
                submitted.append(r.rid)
            remaining = len(reqs)
            while remaining:
                item = await self._next(queue, request, poll_disconnect)
                if isinstance(item, Exception):
                    raise item
                st = states.get(item.rid)
                if st is None:
                    continue
                if item.error is not None:
                    raise InvalidRequestError(*_split_field(item.error))
                prev = st.last_token_time or st.created
                st.apply(item)
                if log is not None:
                    self._observe(log, st, item, prev)
                if st.finished:
                    remaining -= 1
                    fr = st.finish_reason or {}
                    if fr.get("type") == "abort" and (fr.get("status_code") or 0) >= 400:
                        raise RequestFailed(fr["status_code"], fr.get("message") or "aborted")
                yield st
        finally:
            for rid in submitted:
                if not states[rid].finished:
                    self.client.abort(rid)
                self.client.release(rid)

    async def _next(self, queue: asyncio.Queue, request: Any, poll: bool) -> Any:
        if not poll:  # engine death reaches every queue as an item (EngineClient._fail_all)
            return await queue.get()
        while True:
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if poll and request is not None and await request.is_disconnected():
                    raise ClientDisconnected() from None
                if not self.client.engine_alive and queue.empty():
                    raise EngineUnavailableError("engine process is not running") from None

    @staticmethod
    def _observe(m: ServerMetrics, st: SeqState, out: ReqOutput, prev: float) -> None:
        n = len(out.new_output_ids)
        if n:
            now = time.time()
            if st.last_token_time is None:
                m.observe_first_token(now - st.created)
                if n > 1:
                    m.observe_tokens(0.0, n - 1)
            else:
                m.observe_tokens(now - prev, n)
            st.last_token_time = now
        if st.finished:
            aborted = (st.finish_reason or {}).get("type") == "abort"
            m.observe_finished(st.prompt_tokens, st.completion_tokens, st.cached_tokens,
                               st.e2e_latency, aborted)


def _split_field(message: str) -> tuple[str, str]:
    """Engine errors start with the field name ("field: why"), as ``InvalidRequestError``."""
    head, sep, tail = message.partition(": ")
    return (head, tail) if sep and " " not in head else ("request", message)
