"""Typed messages between the API process and the engine process (pickled over ZMQ).

Work: ``GenerateReqInput`` and ``AbortReq`` go in; ``BatchOutput`` (one ``ReqOutput`` per request
that made progress in a step) comes out after every step. Control: a ``ControlReq`` carries a
``method`` name from a fixed set and gets one ``ControlResp`` with the same ``req_id``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.types import SamplingParams


@dataclass
class GenerateReqInput:
    """One sequence to generate (the API process expands batches and ``n`` into these).

    ``input_ids``: prompt token ids (already tokenized). ``logprob_start_len`` -1 means output
    logprobs only; >= 0 also returns prompt logprobs from that position.
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    log_metrics: bool = True  # False for health probes: not user load


@dataclass
class AbortReq:
    """Abort requests whose rid starts with ``rid`` (SGLang matches by prefix), or all."""

    rid: str = ""
    abort_all: bool = False


@dataclass
class ReqOutput:
    """Progress of one request in one step. ``new_output_ids``/``new_text`` are the delta since
    the last ``ReqOutput`` for this rid; logprob lists likewise hold only new positions, each
    entry ``(logprob: float, token_id: int)``; top lists hold a list of such pairs per position.
    ``finish_reason`` is SGLang's JSON object once finished, else None.
    """

    rid: str
    new_output_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    total_retractions: int = 0
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    error: str | None = None  # set when the request was rejected (bad input): HTTP 400


@dataclass
class BatchOutput:
    """Everything one engine step produced; sent even when empty after a probe-only step."""

    outputs: list[ReqOutput]
    # engine gauges after this step: num_running_reqs, num_waiting_reqs, kv_used_tokens,
    # kv_total_tokens, cache_hit_tokens (cumulative), prompt_tokens (cumulative, computed+cached)
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class ControlReq:
    """A control call run between steps on every rank. ``method`` is one of the Scheduler's
    control methods (``flush_cache``, ``get_internal_state``, ...); ``kwargs`` its arguments."""

    req_id: int
    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlResp:
    req_id: int
    success: bool
    message: str = ""
    data: Any = None


@dataclass
class ReadyMsg:
    """Sent once by the engine after weights, KV, graphs and warm-up are done."""

    max_total_num_tokens: int
    max_req_input_len: int
    context_len: int
    vocab_size: int


@dataclass
class StartupError:
    """Sent by the engine instead of ``ReadyMsg`` when start-up fails; the server exits."""

    message: str
