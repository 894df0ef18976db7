"""Core request types: sampling parameters, finish reasons, forward modes, requests.

Sampling defaults and valid ranges follow SGLang's ``SamplingParams``
(shared/reference/sglang-facts.md, section 1.2).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any


class InvalidRequestError(ValueError):
    """A request field is invalid. ``field`` names it; the message says why.

    The HTTP layer maps this to 400 with the message, which always starts with the field name.
    """

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    IDLE = 3
    TARGET_VERIFY = 4  # reserved for speculative decoding
    DRAFT_EXTEND = 5  # reserved
    DRAFT_DECODE = 6  # reserved


_TOP_K_ALL = 1 << 30  # SGLang stores top_k=-1 ("whole vocabulary") as 1 << 30


@dataclass
class SamplingParams:
    """Per-request sampling parameters with SGLang's names and defaults.

    ``temperature`` in [0, 1e-6) means greedy. ``top_k`` is -1 (off) or >= 1. ``stop`` is a
    string or list of strings; ``logit_bias`` maps token id (int or numeric string) to an
    additive bias on the logits.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a JSON dict. Raises InvalidRequestError for unknown keys or wrong types."""
        d = dict(d or {})
        known = cls.__dataclass_fields__
        for key in d:
            if key not in known:
                raise InvalidRequestError(f"sampling_params.{key}", "unknown sampling parameter")
        sp = cls(**d)
        sp._check_types()
        return sp

    def _check_types(self) -> None:
        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not math.isfinite(v):
                raise InvalidRequestError(f"sampling_params.{name}", "must be a finite number")
        for name in ("max_new_tokens", "top_k", "min_new_tokens", "n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise InvalidRequestError(f"sampling_params.{name}", "must be an integer")
        if self.sampling_seed is not None and (
                not isinstance(self.sampling_seed, int) or isinstance(self.sampling_seed, bool)):
            raise InvalidRequestError("sampling_params.sampling_seed", "must be an integer")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise InvalidRequestError("sampling_params.stop",
                                          "must be a non-empty string or a list of them")
        if self.stop_token_ids is not None and (
                not isinstance(self.stop_token_ids, list)
                or not all(isinstance(t, int) and not isinstance(t, bool)
                           for t in self.stop_token_ids)):
            raise InvalidRequestError("sampling_params.stop_token_ids", "must be a list of ints")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_num(v) for v in self.logit_bias.values()):
                raise InvalidRequestError("sampling_params.logit_bias",
                                          "must map token ids to numbers")

    def validate(self, vocab_size: int) -> None:
        """Check SGLang's value ranges. Raises InvalidRequestError naming the field."""
        self._check_types()
        f = "sampling_params."
        if self.temperature < 0:
            raise InvalidRequestError(f + "temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f + "top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f + "min_p", f"must be in [0, 1], got {self.min_p}")
        if not (self.top_k >= 1 or self.top_k == -1):
            raise InvalidRequestError(f + "top_k", f"must be -1 or >= 1, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f + name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:  # 0 would divide logits by zero
            raise InvalidRequestError(f + "repetition_penalty",
                                      f"must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens < 0:
            raise InvalidRequestError(f + "max_new_tokens",
                                      f"must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidRequestError(f + "min_new_tokens",
                                      f"must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.n < 1:
            raise InvalidRequestError(f + "n", f"must be >= 1, got {self.n}")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f + "stop_token_ids", f"token id {t} outside vocabulary")
        for k in (self.logit_bias or {}):
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise InvalidRequestError(f + "logit_bias", f"key {k!r} is not a token id")
            if not 0 <= tid < vocab_size:
                raise InvalidRequestError(f + "logit_bias", f"token id {tid} outside vocabulary")

    def for_sample(self, j: int) -> "SamplingParams":
        """The params of sample ``j`` of an ``n``-way request: ``n`` = 1, and a given
        ``sampling_seed`` offset by ``j`` so the samples differ yet are reproducible as a set."""
        seed = None if self.sampling_seed is None else self.sampling_seed + j
        return dataclasses.replace(self, n=1, sampling_seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def effective_top_k(self) -> int:
        return 1 if self.temperature < 1e-6 else (_TOP_K_ALL if self.top_k == -1 else self.top_k)

    @property
    def stop_strs(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


@dataclass
class FinishReason:
    """Why a request finished; ``to_json`` gives SGLang's ``finish_reason`` object."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message, "status_code": self.status_code,
                "err_type": None}


class ReqStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)  # identity: requests are found in and removed from lists
class Req:
    """One sequence being generated.

    ``origin_input_ids`` is the prompt; ``output_ids`` the generated tokens. ``fill_ids`` =
    prompt + output is what the KV must hold; ``num_computed_tokens`` counts how many of them
    already have KV (prefix-cache hits included), so chunked prefill, prefix reuse and decode
    are one budget (vLLM v1's idea).
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    log_metrics: bool = True
    created_time: float = field(default_factory=time.time)

    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    to_abort: FinishReason | None = None
    num_computed_tokens: int = 0
    cached_tokens: int = 0
    req_pool_idx: int | None = None
    kv_slots: list[int] = field(default_factory=list)  # KV slot of each computed token
    prefix_node: Any = None  # radix node pinned for this request's cached prefix
    num_cached_in_tree: int = 0  # how many leading tokens of fill_ids are owned by the tree
    prompt_logprobs_done: bool = False
    total_retractions: int = 0
    # logprobs: lists of (logprob, token_id) and per-position top-k [(logprob, token_id), ...]
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    # detokenizer state and text
    detok: Any = None
    text: str = ""
    num_sent_ids: int = 0  # output ids already streamed
    num_sent_text: int = 0
    num_sent_logprobs: int = 0
    first_token_time: float | None = None
    weight_version: str = "default"

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
