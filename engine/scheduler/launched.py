"""One forward step in two halves: ``launch`` (build the batch, run the model, sample on the
device, start the copy of the sampled ids to the host) and ``finish`` (wait for those ids, append
them, finish checks, detokenize, outputs).

The overlap scheduler (SGLang's ``event_loop_overlap``, shared/reference/sglang-facts.md 6.2)
launches step N+1 before it finishes step N, so the host work of one step runs while the GPU
computes the other. Until ``finish`` runs, a token sampled by step N sits in ``req.output_ids`` as
a placeholder ``-(i + 1)``, i = the request's row among step N's sampled requests; step N+1's
input ids are resolved on the device from step N's sampled ids (``resolve_placeholders``). A
request that step N finishes (EOS, stop string) may already be in step N+1: ``finish`` drops its
placeholder there and step N+1's token for it is discarded. Without overlap, ``finish`` follows
``launch`` at once and no placeholder outlives the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runner.forward_batch import build_forward_batch
from engine.runner.sampler import (SampleOutput, SamplingBatchInfo, greedy_next_ids,
                                   plain_greedy)
from engine.scheduler import output
from engine.types import ForwardMode, Req, ReqStatus


@dataclass
class LaunchedStep:
    """A step whose model forward and sampling are queued on the device.

    ``prompt`` lists (request, prompt-logprob positions, first row in ``logits``); ``logits``
    [R, V] f32 are the step's logits rows (read by ``finish`` only for prompt logprobs, and
    such a step is never deferred: a later CUDA-graph replay overwrites graph outputs).
    ``sample_reqs[i]`` sampled ``res.next_token_ids[i]`` ([S] int64, on the device);
    ``slots[i]`` is the index of its
    placeholder in ``output_ids`` (None when ``max_new_tokens`` is 0: nothing is appended).
    ``host_ids`` ([S] int64, pinned on CUDA) holds the same ids once ``done`` has fired."""

    reqs: list[Req]
    prompt: list[tuple[Req, list[int], int]]
    logits: torch.Tensor
    sample_reqs: list[Req]
    slots: list[int | None]
    res: SampleOutput
    host_ids: torch.Tensor
    done: torch.cuda.Event | None

    @property
    def deferrable(self) -> bool:
        """``finish`` may wait until after the next launch: it needs no logits, and no request
        of the step samples from token values (the next step would have to drain it first)."""
        return not self.prompt and not any(needs_token_values(r) for r in self.reqs)


def placeholder(i: int) -> int:
    """The stand-in for the token that row ``i`` of the in-flight step sampled."""
    return -(i + 1)


def resolve_placeholders(input_ids: torch.Tensor, prev_next_ids: torch.Tensor) -> None:
    """In place, on the device: every ``input_ids`` entry ``-(i + 1)`` becomes
    ``prev_next_ids[i]``. ``input_ids`` [T] int64, ``prev_next_ids`` [S] int64 (S >= 1)."""
    rows = (-input_ids - 1).clamp_(min=0)
    input_ids.copy_(torch.where(input_ids < 0, prev_next_ids[rows], input_ids))


def needs_token_values(req: Req) -> bool:
    """Sampling reads the values of ``output_ids`` (penalties), so no placeholder may be there."""
    sp = req.sampling_params
    return sp.frequency_penalty != 0 or sp.presence_penalty != 0 or sp.repetition_penalty != 1


def _to_host(ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    if ids.device.type != "cuda":
        return ids, None
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def fill_slice(req: Req, start: int, n: int) -> list[int]:
    """``req.fill_ids[start:start + n]`` without building ``fill_ids`` (prompt + output, a
    copy of the whole sequence) each step."""
    plen = len(req.origin_input_ids)
    if start >= plen:
        return req.output_ids[start - plen:start - plen + n]
    if start + n <= plen:
        return req.origin_input_ids[start:start + n]
    return req.origin_input_ids[start:] + req.output_ids[:start + n - plen]


def launch(sched, reqs: list[Req], ext_lens: list[int], mode: ForwardMode,
           prev: LaunchedStep | None) -> LaunchedStep:
    """Queue the forward and sampling of ``reqs`` (``ext_lens[j]`` new tokens each) on the
    device. ``prev``: the step still in flight, whose placeholders may be among the inputs.
    Raises RuntimeError on a placeholder without such a step (a scheduler bug)."""
    ids, pos, locs, prefix, logit_rows, plan = [], [], [], [], [], []
    for req, n in zip(reqs, ext_lens):
        start = req.num_computed_tokens
        base = len(ids)
        ids.extend(fill_slice(req, start, n))
        pos.extend(range(start, start + n))
        locs.extend(req.kv_slots[start:start + n])
        prefix.append(start)
        prompt_rows = output.prompt_logprob_positions(req, start, n)
        logit_rows.extend(base + p - start for p in prompt_rows)
        samples = start + n == req.seq_len
        if samples:
            logit_rows.append(base + n - 1)
        plan.append((prompt_rows, samples))
    runner = sched.runner
    batch = build_forward_batch(mode, ids, pos, locs, [r.req_pool_idx for r in reqs], prefix,
                                ext_lens, logit_rows, runner.device)
    if min(ids) < 0:
        if prev is None:
            raise RuntimeError("placeholder token without a step in flight")
        resolve_placeholders(batch.input_ids, prev.res.next_token_ids)
    logits = runner.forward(batch).next_token_logits
    for req, n in zip(reqs, ext_lens):
        req.num_computed_tokens += n
    prompt, sample_reqs, sample_rows, row = [], [], [], 0
    for req, (prompt_rows, samples) in zip(reqs, plan):
        if prompt_rows:
            prompt.append((req, prompt_rows, row))
            row += len(prompt_rows)
        if samples:
            sample_reqs.append(req)
            sample_rows.append(row)
            row += 1
    res = SampleOutput(next_token_ids=torch.empty(0, dtype=torch.int64))
    if sample_reqs:
        rows = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
        if plain_greedy(sample_reqs, sched.eos_token_ids):
            # argmax on the device, no per-row sampling tensors (same tokens as the sampler)
            res.next_token_ids = greedy_next_ids(rows)
        else:
            info = SamplingBatchInfo.from_reqs(sample_reqs, sched.vocab_size, logits.device,
                                               sched.eos_token_ids)
            want_lp = any(r.return_logprob for r in sample_reqs)
            top_n = max(r.top_logprobs_num for r in sample_reqs)
            res = sched.sampler(rows, info, sample_reqs, want_lp, top_n)
    host_ids, done = _to_host(res.next_token_ids)
    slots: list[int | None] = []
    for i, req in enumerate(sample_reqs):
        if req.sampling_params.max_new_tokens == 0:
            slots.append(None)
            continue
        slots.append(len(req.output_ids))
        req.output_ids.append(placeholder(i))
    return LaunchedStep(reqs, prompt, logits, sample_reqs, slots, res, host_ids, done)


def finish(sched, step: LaunchedStep) -> list:
    """Wait for ``step``'s sampled ids and apply them: prompt logprobs, append + finish checks,
    KV release of finished requests, the ``ReqOutput``s to send (in request order)."""
    for req, positions, row in step.prompt:
        output.add_prompt_logprobs(req, positions, step.logits[row:row + len(positions)])
    if not step.sample_reqs:
        return []
    if step.done is not None:
        step.done.synchronize()
    next_ids = step.host_ids.tolist()
    outs = []
    for i, req in enumerate(step.sample_reqs):
        if req.finished:  # ended by the step before (overlap): this token is void
            continue
        k = step.slots[i]
        tail = []
        if k is not None:  # the placeholder, then the one of a later step in flight
            tail = req.output_ids[k + 1:]
            del req.output_ids[k:]
        n_before = len(req.output_ids)
        done = output.append_token(req, next_ids[i], step.res, i, sched.eos_token_ids,
                                   sched.context_len)
        if req.log_metrics:
            sched.stats["generation_tokens"] += len(req.output_ids) - n_before
        if done:
            sched.running.remove(req)
            sched.mem.release(req)
            req.status = ReqStatus.FINISHED
            outs.append(output.make_output(req, sched.weight_version, final=True))
            continue
        if req.stream:
            outs.append(output.make_output(req, sched.weight_version, final=False))
        req.output_ids.extend(tail)
    return outs
