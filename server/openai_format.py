"""Response objects of the OpenAI-compatible routes (completions and chat), built from
``SeqState``. Shapes follow OpenAI's API plus SGLang's extras (``matched_stop``,
``metadata.weight_version``); see sglang-facts.md section 1.7.
"""

from __future__ import annotations

from typing import Any

from server.generation import SeqState


def finish_reason(st: SeqState) -> str | None:
    """OpenAI's finish reason: "stop" | "length" | "abort" (None while running)."""
    if not st.finished or not st.finish_reason:
        return None
    return st.finish_reason.get("type")


def matched_stop(st: SeqState) -> Any:
    fr = st.finish_reason or {}
    return fr.get("matched") if fr.get("type") == "stop" else None


def usage(states: list[SeqState], n: int) -> dict[str, Any]:
    """Token usage; prompt tokens are counted once per prompt (every ``n``-th sequence)."""
    prompt = sum(st.prompt_tokens for st in states[::n])
    completion = sum(st.completion_tokens for st in states)
    cached = sum(st.cached_tokens for st in states[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _tok(tokenizer: Any, tid: int) -> str:
    """The text of one token as it reads inside a sequence. Decoding it alone would drop a
    SentencePiece token's leading space ("▁upon" -> "upon"), so decode it after an anchor token
    and cut the anchor's text off."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
    head = tokenizer.decode(anchor)
    both = tokenizer.decode(anchor + [int(tid)])
    return both[len(head):] if both.startswith(head) else tokenizer.decode([int(tid)])


def completion_logprobs(tokenizer: Any, pairs: list, tops: list, offset0: int = 0
                        ) -> dict[str, Any]:
    """Legacy completions ``logprobs`` object: tokens, token_logprobs, top_logprobs (one
    {token: logprob} dict per position) and character offsets into the text."""
    tokens = [_tok(tokenizer, tid) for _, tid in pairs]
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = [{_tok(tokenizer, tid): float(lp) for lp, tid in pos_list} for pos_list in tops]
    return {"tokens": tokens,
            "token_logprobs": [None if lp is None else float(lp) for lp, _ in pairs],
            "top_logprobs": top or None, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, pairs: list, tops: list) -> dict[str, Any]:
    """Chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for i, (lp, tid) in enumerate(pairs):
        tok = _tok(tokenizer, tid)
        alts = [{"token": (t := _tok(tokenizer, a_tid)), "logprob": float(a_lp),
                 "bytes": list(t.encode())} for a_lp, a_tid in (tops[i] if i < len(tops) else [])]
        content.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode()),
                        "top_logprobs": alts})
    return {"content": content}


def completion_response(rid: str, created: int, model: str, states: list[SeqState], n: int,
                        tokenizer: Any, want_logprobs: bool, weight_version: str,
                        echo: list[str] | None = None) -> dict[str, Any]:
    """The non-streamed completions answer. ``echo``: per prompt, its text, put before each
    choice's text; its tokens (logprob None for the first) then lead the logprobs too."""
    choices = []
    for i, st in enumerate(states):
        head = echo[i // n] if echo is not None else ""
        pairs, tops = st.output_token_logprobs, st.output_top_logprobs
        if echo is not None:
            pairs = st.input_token_logprobs + pairs
            tops = (st.input_top_logprobs + tops) if tops else []
        lp = completion_logprobs(tokenizer, pairs, tops) if want_logprobs else None
        choices.append({"index": i, "text": head + st.text, "logprobs": lp,
                        "finish_reason": finish_reason(st), "matched_stop": matched_stop(st)})
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(states, n),
            "metadata": {"weight_version": weight_version}}


def chat_response(rid: str, created: int, model: str, states: list[SeqState], n: int,
                  tokenizer: Any, want_logprobs: bool, weight_version: str) -> dict[str, Any]:
    choices = []
    for i, st in enumerate(states):
        lp = (chat_logprobs(tokenizer, st.output_token_logprobs, st.output_top_logprobs)
              if want_logprobs else None)
        choices.append({"index": i, "message": {"role": "assistant", "content": st.text,
                                                "reasoning_content": None, "tool_calls": None},
                        "logprobs": lp, "finish_reason": finish_reason(st),
                        "matched_stop": matched_stop(st)})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(states, n),
            "metadata": {"weight_version": weight_version}}


def completion_chunk(rid: str, created: int, model: str, st: SeqState, tokenizer: Any,
                     want_logprobs: bool) -> dict[str, Any]:
    """One streamed completions chunk carrying this update's text delta."""
    lp = None
    k = len(st.last_ids_delta)
    if want_logprobs and k:
        lp = completion_logprobs(tokenizer, st.output_token_logprobs[-k:],
                                 st.output_top_logprobs[-k:] if st.output_top_logprobs else [],
                                 len(st.text) - len(st.last_text_delta))
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": st.index, "text": st.last_text_delta, "logprobs": lp,
                         "finish_reason": finish_reason(st), "matched_stop": matched_stop(st)}]}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish: str | None = None, logprobs: Any = None,
               matched: Any = None) -> dict[str, Any]:
    """One streamed chat chunk (``object: chat.completion.chunk``)."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish, "matched_stop": matched}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, states: list[SeqState],
                n: int) -> dict[str, Any]:
    """The final ``stream_options.include_usage`` chunk: empty choices plus usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(states, n)}
