"""``Engine``: the offline Python API. ``generate`` runs requests to completion in the caller's
thread; ``async_generate`` streams one request while a background thread steps the scheduler.

    engine = Engine(model_path="tests/fixtures/stories260K")
    engine.generate("Once upon a time", {"temperature": 0, "max_new_tokens": 16})["text"]
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Any, AsyncIterator

import torch

from engine.config import EngineArgs
from engine.distributed.parallel_state import ParallelState
from engine.io_struct import AbortReq, GenerateReqInput, ReqOutput
from engine.runner.model_runner import ModelRunner
from engine.scheduler.scheduler import Scheduler
from engine.tokenizer import load_tokenizer
from engine.types import InvalidRequestError, SamplingParams
from engine.weights.loader import load_model_config, resolve_model_path

logger = logging.getLogger(__name__)


def create_scheduler(args: EngineArgs, ps: ParallelState) -> Scheduler:
    """Load config, tokenizer, weights and KV memory for this rank; log each phase."""
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    model_path = resolve_model_path(args.model_path)
    t0 = time.time()
    model_config = load_model_config(model_path)
    tokenizer = load_tokenizer(resolve_model_path(args.tokenizer_path or args.model_path))
    logger.info("loading weights from %s", model_path)
    runner = ModelRunner(args, model_path, model_config, ps)
    logger.info("weights loaded in %.1f s", time.time() - t0)
    return Scheduler(args, runner, tokenizer, model_config)


def warm_up(scheduler: Scheduler) -> None:
    """Run one short greedy request so kernels are compiled before the server is ready."""
    sp = SamplingParams(max_new_tokens=2, temperature=0.0)
    scheduler.add_request(GenerateReqInput("WARMUP", [0, 1, 2][:scheduler.max_req_input_len], sp,
                                           log_metrics=False))
    while scheduler.busy:
        scheduler.step()


def _merge(acc: dict[str, Any] | None, out: ReqOutput) -> dict[str, Any]:
    """Fold a delta into SGLang's response shape (text, output_ids, meta_info)."""
    if acc is None:
        acc = {"text": "", "output_ids": [], "meta_info": {"id": out.rid}}
    acc["text"] += out.new_text
    acc["output_ids"] += out.new_output_ids
    m = acc["meta_info"]
    m.update(finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
             completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
             weight_version=out.weight_version, total_retractions=out.total_retractions)
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs",
                "input_top_logprobs"):
        m.setdefault(key, []).extend(getattr(out, key))
    return acc


class Engine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        self.args = args or EngineArgs(**kwargs)
        self.scheduler = create_scheduler(self.args, ParallelState())
        self.tokenizer = self.scheduler.tokenizer
        self._lock = threading.Lock()  # one stepping thread at a time
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None

    def _to_inputs(self, prompt, input_ids, sampling_params, rid, **kw) -> list[GenerateReqInput]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("text", "exactly one of text or input_ids is required")
        batch = isinstance(prompt, list) or (input_ids is not None and input_ids
                                             and isinstance(input_ids[0], list))
        ids = input_ids if input_ids is not None else prompt
        items = ids if batch else [ids]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        base = rid or uuid.uuid4().hex
        reqs = []
        for i, (item, spd) in enumerate(zip(items, sps)):
            toks = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            sp = SamplingParams.from_dict(spd)
            sp.validate(self.scheduler.vocab_size)
            for j in range(sp.n):
                r = f"{base}_{i}" if batch else base
                r = f"{r}_{j}" if sp.n > 1 else r
                reqs.append(GenerateReqInput(r, toks, sp.for_sample(j), **kw))
        return reqs

    def generate(self, prompt: str | list[str] | None = None, sampling_params=None,
                 input_ids: list[int] | list[list[int]] | None = None, rid: str | None = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1) -> dict | list[dict]:
        """Run to completion. One prompt -> a dict {text, output_ids, meta_info}; a list of
        prompts (or ``n`` > 1) -> a list of them. Raises InvalidRequestError naming a bad field
        (no request is queued then)."""
        reqs = self._to_inputs(prompt, input_ids, sampling_params, rid,
                               return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                               logprob_start_len=logprob_start_len)
        for r in reqs:
            self.scheduler._validate(r)
        results: dict[str, dict] = {}
        with self._lock:
            for r in reqs:
                self.scheduler.add_request(r)
            while len([v for v in results.values() if v["meta_info"]["finish_reason"]]) < len(reqs):
                for out in self.scheduler.step():
                    results[out.rid] = _merge(results.get(out.rid), out)
        ordered = [results[r.rid] for r in reqs]
        single = len(ordered) == 1 and not isinstance(prompt, list) and not (
            input_ids and isinstance(input_ids[0], list))
        return ordered[0] if single else ordered

    # ------------------------------------------------------------ async streaming
    async def async_generate(self, prompt: str | None = None, sampling_params=None,
                             input_ids: list[int] | None = None,
                             rid: str | None = None) -> AsyncIterator[ReqOutput]:
        """Stream one request: yields ``ReqOutput`` deltas until the one with ``finished``."""
        (req,) = self._to_inputs(prompt, input_ids, sampling_params, rid, stream=True)
        self.scheduler._validate(req)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[req.rid] = (asyncio.get_running_loop(), q)
        self._inbox.put(req)
        self._ensure_thread()
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.pop(req.rid, None) is not None:
                self._inbox.put(AbortReq(rid=req.rid))

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            msg = self._inbox.get() if not self.scheduler.busy else None
            with self._lock:
                while msg is not None or not self._inbox.empty():
                    msg = msg if msg is not None else self._inbox.get_nowait()
                    if isinstance(msg, AbortReq):
                        self.scheduler.abort(msg)
                    else:
                        self.scheduler.add_request(msg)
                    msg = None
                for out in self.scheduler.step():
                    loop_q = self._streams.get(out.rid)
                    if loop_q is not None:
                        loop_q[0].call_soon_threadsafe(loop_q[1].put_nowait, out)
