"""Request bodies (pydantic 2), parsed in strict JSON mode so wrong types are rejected rather
than coerced, and helpers that turn parse failures into a 400 message naming the field.

Field names and defaults follow SGLang's ``GenerateReqInput`` and OpenAI's protocol
(shared/reference/sglang-facts.md sections 1.2 and 1.7). Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from engine.types import InvalidRequestError

M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class GenerateRequest(_Body):
    """``POST /generate``: exactly one of ``text`` / ``input_ids``; single or batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAIBase(_Body):
    """Sampling fields shared by completions and chat (OpenAI names + SGLang extras)."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    rid: str | None = None

    def sampling_dict(self, max_new_tokens: int | None) -> dict[str, Any]:
        """SGLang sampling_params dict (only the fields that were given)."""
        mapping = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                   "min_p": self.min_p, "frequency_penalty": self.frequency_penalty,
                   "presence_penalty": self.presence_penalty,
                   "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias,
                   "min_new_tokens": self.min_tokens, "stop": self.stop,
                   "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                   "skip_special_tokens": self.skip_special_tokens, "sampling_seed": self.seed,
                   "max_new_tokens": max_new_tokens}
        return {k: v for k, v in mapping.items() if v is not None}


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        """Raise ``InvalidRequestError`` for OpenAI features this server does not implement
        (rather than silently ignoring them)."""
        if self.suffix:
            raise InvalidRequestError("suffix", "is not supported (no fill-in-the-middle)")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of", "is not supported; use n")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Raise ``InvalidRequestError`` for OpenAI features this server does not implement:
        tool calls, structured output and non-text content parts."""
        if self.tools:
            raise InvalidRequestError("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", "tool calling is not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("response_format", "only {'type': 'text'} is supported")
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text":
                    raise InvalidRequestError(f"messages.{i}.content.{j}.type",
                                              f"{part.type!r} parts are not supported (text "
                                              "only)")


def parse_body(model: type[M], body: bytes) -> M:
    """Parse a JSON body into ``model`` (and run its ``check_supported`` if it has one). Raises
    ``InvalidRequestError`` whose field is the first failing location ("body" for malformed
    JSON)."""
    if not body.strip():
        raise InvalidRequestError("body", "request body is empty; expected a JSON object")
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as e:
        raise invalid_from_validation(e) from None
    check = getattr(parsed, "check_supported", None)
    if check is not None:
        check()
    return parsed


def invalid_from_validation(e: ValidationError) -> InvalidRequestError:
    """First error of a pydantic ``ValidationError`` as ``InvalidRequestError``."""
    err = e.errors()[0]
    if err.get("type") == "json_invalid":
        return InvalidRequestError("body", f"malformed JSON: {err.get('msg')}")
    loc = [str(x) for x in err.get("loc", ()) if not _is_union_tag(x)]
    return InvalidRequestError(".".join(loc) or "body", err.get("msg", "invalid value"))


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the tried union member (e.g. "str", "list[int]") into the location
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool",
                                                                "dict", "list", "none"))
