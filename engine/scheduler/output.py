"""Per-request result handling: appending a sampled token, finish checks (EOS, stop token ids,
stop strings, max_new_tokens, context length), logprob bookkeeping and the ``ReqOutput`` deltas.

Finish semantics follow SGLang (shared/reference/sglang-facts.md, section 1.2): a stop string
ends generation at its earliest match; the text after it (and the stop itself unless
``no_stop_trim``) is dropped.
"""

from __future__ import annotations

import torch

from engine.io_struct import GenerateReqInput, ReqOutput
from engine.runner.sampler import SampleOutput, compute_prompt_logprobs
from engine.tokenizer import IncrementalDetokenizer, find_stop, stop_prefix_len
from engine.types import FinishReason, Req, SamplingParams


DETOK_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output (SGLang's surrounding offset)


def make_detokenizer(tokenizer, sp: SamplingParams, prompt: list[int]) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, skip_special_tokens=sp.skip_special_tokens,
                                  spaces_between_special_tokens=sp.spaces_between_special_tokens,
                                  context_ids=prompt[-DETOK_CONTEXT_TOKENS:])


def rejection(r: GenerateReqInput, message: str, weight_version: str) -> ReqOutput:
    """The answer to a request refused at admission (HTTP 400)."""
    reason = FinishReason("abort", message=message, status_code=400).to_json()
    return ReqOutput(r.rid, [], "", True, reason, len(r.input_ids), 0, 0, weight_version,
                     error=message)


def append_token(req: Req, token: int, res: SampleOutput, row: int, eos_ids: tuple[int, ...],
                 context_len: int) -> bool:
    """Append the sampled ``token`` (row ``row`` of ``res``) to ``req``, detokenize, and
    decide whether ``req`` finished. Returns True when it did."""
    sp = req.sampling_params
    if sp.max_new_tokens == 0:  # prefill only (e.g. for prompt logprobs)
        req.finish_reason = FinishReason("length", length=0)
        return True
    req.output_ids.append(token)
    if req.return_logprob:
        req.output_token_logprobs.append((float(res.logprobs[row]), token))
        if req.top_logprobs_num > 0:
            vals = res.top_logprobs_val[row, :req.top_logprobs_num].tolist()
            idx = res.top_logprobs_idx[row, :req.top_logprobs_num].tolist()
            req.output_top_logprobs.append(list(zip(vals, idx)))
    n_out = len(req.output_ids)
    before = len(req.text)
    if n_out >= sp.min_new_tokens and (
            (not sp.ignore_eos and token in eos_ids) or token in (sp.stop_token_ids or ())):
        # SGLang trims a matched stop token from the text (kept in output_ids)
        if sp.no_stop_trim:
            req.text += req.detok.add([token])
        req.finish_reason = FinishReason("stop", matched=token)
        return True
    req.text += req.detok.add([token])
    stops = sp.stop_strs
    if stops and n_out >= sp.min_new_tokens:
        hit = find_stop(req.text, stops, before)
        if hit is not None:
            idx, matched = hit
            req.text = req.text[:idx + (len(matched) if sp.no_stop_trim else 0)]
            req.finish_reason = FinishReason("stop", matched=matched)
            return True
    if n_out >= sp.max_new_tokens or req.seq_len >= context_len:
        req.finish_reason = FinishReason("length", length=n_out)
        return True
    return False


def prompt_logprob_positions(req: Req, start: int, n: int) -> list[int]:
    """Positions in [start, start + n) whose logits give prompt-token logprobs: position p
    predicts prompt token p + 1, for tokens from ``logprob_start_len`` on."""
    if not req.return_logprob or req.logprob_start_len < 0 or req.prompt_logprobs_done:
        return []
    first = max(0, req.logprob_start_len - 1)
    last = len(req.origin_input_ids) - 2  # the last prompt position predicts output token 0
    return [p for p in range(start, start + n) if first <= p <= last]


def add_first_prompt_logprob(req: Req) -> None:
    """SGLang reports None for the first prompt token (nothing predicts it). A one-token prompt
    has nothing else to report: it is done at admission."""
    req.input_token_logprobs.append((None, req.origin_input_ids[0]))
    req.input_top_logprobs.append([])
    req.prompt_logprobs_done = len(req.origin_input_ids) == 1


def add_prompt_logprobs(req: Req, positions: list[int], logits: torch.Tensor) -> None:
    """Record logprobs of prompt tokens ``positions + 1`` from ``logits`` [len(positions), V]
    float32. SGLang reports None for the first prompt token (nothing predicts it)."""
    if not req.input_token_logprobs and req.logprob_start_len == 0:
        add_first_prompt_logprob(req)
    targets = torch.tensor([req.origin_input_ids[p + 1] for p in positions],
                           device=logits.device)
    lps, tops = compute_prompt_logprobs(logits, targets, req.top_logprobs_num)
    for p, lp, top in zip(positions, lps, tops):
        req.input_token_logprobs.append((lp, req.origin_input_ids[p + 1]))
        req.input_top_logprobs.append(top)
    if positions and positions[-1] == len(req.origin_input_ids) - 2:
        req.prompt_logprobs_done = True


def make_output(req: Req, weight_version: str, final: bool) -> ReqOutput:
    """The delta since the last output for ``req``; ``final`` flushes the detokenizer."""
    if final:
        fr = req.finish_reason
        on_stop_str = fr is not None and fr.type == "stop" and isinstance(fr.matched, str)
        if req.detok is not None and not on_stop_str:
            req.text += req.detok.flush()
        req.weight_version = weight_version
    ids = req.output_ids[req.num_sent_ids:]
    end = len(req.text)
    if not final and not req.sampling_params.no_stop_trim:
        end -= stop_prefix_len(req.text, req.sampling_params.stop_strs)
    end = max(end, req.num_sent_text)
    text = req.text[req.num_sent_text:end]
    lp_from = req.num_sent_logprobs
    out = ReqOutput(
        rid=req.rid, new_output_ids=ids, new_text=text, finished=final,
        finish_reason=req.finish_reason.to_json() if final and req.finish_reason else None,
        prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens, weight_version=weight_version,
        total_retractions=req.total_retractions,
        output_token_logprobs=req.output_token_logprobs[lp_from:],
        output_top_logprobs=req.output_top_logprobs[lp_from:],
        input_token_logprobs=req.input_token_logprobs if req.num_sent_ids == 0 else [],
        input_top_logprobs=req.input_top_logprobs if req.num_sent_ids == 0 else [])
    req.num_sent_ids = len(req.output_ids)
    req.num_sent_text = end
    req.num_sent_logprobs = len(req.output_token_logprobs)
    return out
