"""The continuous-batching scheduler. ``step()`` is the algorithm:

    finish aborted requests -> schedule (extend first: chunked prefills, then new requests
    under the token budget; else decode every running request, retracting on KV shortage)
    -> launch (build ForwardBatch, run, sample on the device) -> finish (finish checks,
    detokenize, release KV into the prefix cache).

With overlap (CUDA default; ``--disable-overlap-schedule`` turns it off) a decode step is
launched before the previous step is finished, hiding the host work under the GPU's
(``launched.py`` says how). Anything that needs settled token values drains the step in flight
first: aborts, pauses, penalties, prompt logprobs, possible KV shortage.

Every request's KV is one budget: ``num_computed_tokens`` chases ``len(fill_ids)`` (vLLM v1's
idea), so prefix hits, chunked prefill, decode and recompute after retraction are one path.
"""

from __future__ import annotations

import logging
from collections import deque

from engine.config import EngineArgs, ModelConfig
from engine.io_struct import AbortReq, GenerateReqInput, ReqOutput
from engine.runner.model_runner import ModelRunner
from engine.runner.sampler import Sampler
from engine.scheduler import launched, output
from engine.scheduler.prefix_cache import RadixCache
from engine.scheduler.req_memory import ReqMemory
from engine.types import FinishReason, ForwardMode, InvalidRequestError, Req, ReqStatus
from engine.weights.updater import WeightUpdater

logger = logging.getLogger(__name__)

HEALTH_CHECK_PREFIX = "HEALTH_CHECK"


class Scheduler:
    def __init__(self, args: EngineArgs, runner: ModelRunner, tokenizer,
                 model_config: ModelConfig):
        self.args = args
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.allocator = runner.allocator
        self.req_pool = runner.req_to_token_pool
        self.page_size = runner.page_size
        self.tree = RadixCache(self.allocator, self.page_size, args.disable_radix_cache)
        self.mem = ReqMemory(self.allocator, self.req_pool, self.tree, self.page_size)
        self.sampler = Sampler(args.random_seed)
        self.context_len = runner.context_len
        self.max_running = runner.max_running_requests
        self.chunk_budget = args.chunked_prefill_size if args.chunked_prefill_size and \
            args.chunked_prefill_size > 0 else args.max_prefill_tokens
        self.max_req_input_len = min(self.context_len, self.allocator.capacity_tokens) - 1
        self.weight_version = args.weight_version
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.pending: list[ReqOutput] = []  # rejections and aborts to send with the next step
        self.health_pending = False  # a probe arrived while busy: the next step answers it
        self.paused = False  # pause_generation: no forward steps until continue_generation
        self.hold_new = False  # a weight update waits for in-flight requests; new ones wait in
        self.held: deque[Req] = deque()  # ``held`` (reader/writer lock, writer first)
        self.weights = WeightUpdater(self)  # weight-update control methods
        self.stats = {"prompt_tokens": 0, "cache_hit_tokens": 0, "generation_tokens": 0}
        # launch step N+1 before finishing step N (no gain on CPU, where kernels run inline)
        self.overlap = runner.device.type == "cuda" and not args.disable_overlap_schedule
        self.inflight: launched.LaunchedStep | None = None  # launched, not yet finished

    # ---------------------------------------------------------------- inputs
    def add_request(self, r: GenerateReqInput) -> None:
        """Queue a request, or answer it at once with an error naming the bad field."""
        if r.rid.startswith(HEALTH_CHECK_PREFIX) and (self.busy or self.paused):
            self.health_pending = True  # a busy engine answers from steps it runs anyway
            return
        try:
            self._validate(r)
        except InvalidRequestError as e:
            self.pending.append(output.rejection(r, str(e), self.weight_version))
            return
        sp = r.sampling_params
        req = Req(r.rid, list(r.input_ids), sp, r.return_logprob, r.top_logprobs_num,
                  r.logprob_start_len, r.stream, r.log_metrics)
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - len(r.input_ids))
        req.detok = output.make_detokenizer(self.tokenizer, sp, req.origin_input_ids)
        if req.return_logprob and req.logprob_start_len == 0 and len(r.input_ids) == 1:
            output.add_first_prompt_logprob(req)
        (self.held if self.hold_new else self.waiting).append(req)

    def _validate(self, r: GenerateReqInput) -> None:
        if not r.input_ids:
            raise InvalidRequestError("input_ids", "the prompt is empty")
        if len(r.input_ids) > self.max_req_input_len:
            raise InvalidRequestError(
                "input_ids", f"prompt has {len(r.input_ids)} tokens, more than the limit "
                f"{self.max_req_input_len} (context length {self.context_len})")
        bad = [t for t in r.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError("input_ids", f"token id {bad[0]} outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        r.sampling_params.validate(self.vocab_size)

    def abort(self, a: AbortReq) -> None:
        """Abort by rid prefix (SGLang semantics) or all: waiting ones at once, running ones
        before the next step."""
        def hit(req):
            return a.abort_all or (a.rid and req.rid.startswith(a.rid))

        for queue, req in [(qu, q) for qu in (self.waiting, self.held) for q in qu if hit(q)]:
            queue.remove(req)
            self.mem.release(req)
            req.finish_reason = FinishReason("abort", message="Abort in waiting queue")
            self.pending.append(output.make_output(req, self.weight_version, final=True))
        for req in self.running:
            if hit(req):
                req.to_abort = FinishReason("abort", message="Aborted while running")

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.inflight)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[ReqOutput]:
        """Run one forward step if there is work; return the outputs to send."""
        outs, self.pending = self.pending, []
        if self.inflight is not None and self._must_drain():
            outs.extend(self.drain())
        for req in [q for q in self.running if q.to_abort is not None]:
            self.running.remove(req)
            req.finish_reason = req.to_abort
            self.mem.release(req)
            outs.append(output.make_output(req, self.weight_version, final=True))
        if self.paused:
            return outs
        reqs, ext_lens, mode = self._schedule()
        step = launched.launch(self, reqs, ext_lens, mode, self.inflight) if reqs else None
        outs.extend(self.drain())  # step N's results while step N+1 runs on the device
        # a step whose requests all ended in step N is void: finish it now, so an idle engine
        # is never busy (flush_cache, weight updates) once its last answer is out
        if step is not None:
            if self.overlap and step.deferrable and self.running:
                self.inflight = step
            else:
                outs.extend(launched.finish(self, step))
        return outs

    def drain(self) -> list[ReqOutput]:
        """Finish the step in flight, if any (waits for the device); its outputs."""
        step, self.inflight = self.inflight, None
        return launched.finish(self, step) if step is not None else []

    def _must_drain(self) -> bool:
        """The next step cannot run beside the one in flight: something needs its token
        values (penalties, an abort, a pause) or KV may run short (retraction moves tokens)."""
        if self.paused or self.allocator.available_tokens < len(self.running) * self.page_size:
            return True
        return any(q.to_abort is not None or launched.needs_token_values(q)
                   for q in self.running)

    def _at_limit(self, req: Req) -> bool:
        """The in-flight token is ``req``'s last (max_new_tokens or context length)."""
        return (len(req.output_ids) >= req.sampling_params.max_new_tokens
                or req.seq_len >= self.context_len)

    def _schedule(self) -> tuple[list[Req], list[int], ForwardMode]:
        reqs, lens, budget = [], [], self.chunk_budget
        for req in [q for q in self.running if q.seq_len - q.num_computed_tokens > 1]:
            n = self.mem.alloc_extend(req, budget)
            if n == 0:
                break
            reqs.append(req)
            lens.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self.mem.admit(req):
                break
            hit = req.num_cached_in_tree
            n = self.mem.alloc_extend(req, budget)
            if n == 0:
                self.mem.release(req)
                break
            self.waiting.popleft()
            if req.total_retractions == 0:  # recompute hits are not the client's cache hits
                req.cached_tokens = hit
                if req.log_metrics:
                    self.stats["prompt_tokens"] += len(req.origin_input_ids)
                    self.stats["cache_hit_tokens"] += hit
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            reqs.append(req)
            lens.append(n)
            budget -= n
        if reqs:
            return reqs, lens, ForwardMode.EXTEND
        decode = [q for q in self.running
                  if q.seq_len - q.num_computed_tokens == 1 and not self._at_limit(q)]
        decode = self._alloc_decode(decode)
        if not decode and self.running and self.inflight is None:  # partial prefills stuck
            if len(self.running) > 1:
                self._retract(self.running[-1])
            else:
                self.running[0].to_abort = FinishReason(
                    "abort", message="KV cache too small for this request", status_code=400)
        return decode, [1] * len(decode), ForwardMode.DECODE

    def _alloc_decode(self, reqs: list[Req]) -> list[Req]:
        """One KV slot per decoding request; on shortage retract the newest other running
        request, partial prefills included (its computed KV goes to the prefix cache, it
        recomputes later), or this one when all the others already have their slot. A request
        alone that still finds no room has outgrown the KV pool: it is aborted at the next
        step."""
        ok, pending = [], list(reqs)
        while pending:
            req = pending[0]
            if self.mem.alloc_slots(req, 1):
                ok.append(pending.pop(0))
                continue
            served = set(ok)
            others = [q for q in self.running if q is not req and q not in served]
            if others:
                victim = others[-1]
                if victim in pending:
                    pending.remove(victim)
            elif ok:
                victim = pending.pop(0)
            else:
                req.to_abort = FinishReason("abort", message="KV cache full: sequence longer "
                                            "than the KV pool", status_code=400)
                break
            self._retract(victim)
        return ok

    def _retract(self, req: Req) -> None:
        if self.inflight is not None:  # its placeholder tokens would go back to waiting
            raise RuntimeError("retraction with a step in flight")
        logger.info("retracting %s (KV cache full)", req.rid)
        self.running.remove(req)
        self.mem.release(req)
        if not req.prompt_logprobs_done:  # recomputed from logprob_start_len on readmission
            req.input_token_logprobs.clear()
            req.input_top_logprobs.clear()
        req.status = ReqStatus.WAITING
        req.total_retractions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- control
    def pause_generation(self, mode: str = "abort") -> tuple[bool, str]:
        """Stop forward steps (sglang-facts.md 1.5): ``abort`` aborts every request,
        ``retract`` moves running requests back to waiting (KV to the prefix cache, recomputed
        after continue), ``in_place`` keeps them and their KV."""
        if mode not in ("abort", "retract", "in_place"):
            return False, f"mode must be abort, retract or in_place, got {mode!r}"
        self.pending.extend(self.drain())
        if mode == "abort":
            self.abort(AbortReq(abort_all=True))
        elif mode == "retract":
            for req in reversed([q for q in self.running if q.to_abort is None]):
                self._retract(req)
        self.paused = True
        return True, "Generation paused successfully."

    def continue_generation(self) -> tuple[bool, str]:
        self.paused = False
        return True, "Generation continued successfully."

    @property
    def can_update_weights(self) -> bool:
        """A weight update may run now: paused, or no request in flight."""
        return self.paused or not (self.running or self.waiting)

    def release_held(self) -> None:
        """End of a weight-update wait: requests that arrived meanwhile may run."""
        self.hold_new = False
        self.waiting.extend(self.held)
        self.held.clear()

    def flush_cache(self) -> tuple[bool, str]:
        if self.busy:
            return False, "Cache not flushed: there are running or waiting requests."
        self.tree.reset()
        self.allocator.clear()
        self.req_pool.clear()
        return True, "Cache flushed."

    def get_internal_state(self) -> dict:
        cap = self.allocator.capacity_tokens
        used = cap - self.allocator.available_tokens - self.tree.evictable_tokens
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "kv_used_tokens": used, "kv_total_tokens": cap,
                "token_usage": used / cap, "max_total_num_tokens": cap,
                "max_running_requests": self.max_running,
                "max_req_input_len": self.max_req_input_len,
                "cache_hit_tokens": self.stats["cache_hit_tokens"],
                "prompt_tokens": self.stats["prompt_tokens"],
                "generation_tokens": self.stats["generation_tokens"],
                "weight_version": self.weight_version}
