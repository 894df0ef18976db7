"""The measuring half of ``bench/serving.py``: ShareGPT / random requests, one streaming
request timed chunk by chunk (TTFT, ITL, E2E), a capped-concurrency run with an optional time
limit, and ``sglang.bench_serving``'s summary metrics.

Definitions (sglang-facts.md section 7.4): TTFT = time to the first streamed chunk with
tokens; TPOT per request = (E2E - TTFT) / (output_len - 1); ITL = gaps between streamed chunks
(a chunk of k tokens counts as k gaps of gap/k); concurrency = sum(E2E) / duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAREGPT = ("data", "sharegpt-prompts.jsonl")
CUT = "cut at the time limit"


@dataclass
class Request:
    prompt: str | list[int]
    output_len: int
    prompt_len: int = 0  # tokens, as counted for the context-length filter


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0


def default_dataset_path() -> str:
    """``shared/data/sharegpt-prompts.jsonl`` beside the checkout, else under /work/shared."""
    beside = os.path.join(os.path.dirname(REPO), "shared", *SHAREGPT)
    return beside if os.path.isfile(beside) else os.path.join("/work/shared", *SHAREGPT)


def load_requests(args: argparse.Namespace) -> list[Request]:
    """``--num-prompts`` requests from the ShareGPT file or random token ids.

    ShareGPT rows are taken in file order; like ``sglang.bench_serving``, a row is skipped when
    prompt + output tokens exceed ``--sharegpt-context-len`` (prompt tokens counted with
    ``--tokenizer`` when given, else the file's ``prompt_tokens_smollm2``)."""
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        return [Request([rng.randrange(1, args.random_vocab_size)
                         for _ in range(args.random_input_len)], args.random_output_len,
                        args.random_input_len) for _ in range(args.num_prompts)]
    tokenizer = None
    if args.tokenizer:
        from engine.tokenizer import load_tokenizer  # lazy: transformers takes seconds

        tokenizer = load_tokenizer(args.tokenizer)
        tokenizer.model_max_length = 1 << 62  # only counting: no "longer than the max" warning
    reqs = []
    with open(args.dataset_path) as f:
        for line in f:
            row = json.loads(line)
            out = min(int(row.get("completion_tokens_smollm2") or args.max_output_len),
                      args.max_output_len)
            if not row.get("prompt") or out <= 0:
                continue
            n_in = (len(tokenizer.encode(row["prompt"])) if tokenizer is not None
                    else int(row.get("prompt_tokens_smollm2") or 0))
            if args.sharegpt_context_len and n_in + out > args.sharegpt_context_len:
                continue
            reqs.append(Request(row["prompt"], out, n_in))
            if len(reqs) >= args.num_prompts:
                break
    return reqs


def payload(args: argparse.Namespace, req: Request, model: str) -> tuple[str, dict[str, Any]]:
    """(route, JSON body) for one streaming request."""
    if args.backend == "sglang":
        key = "text" if isinstance(req.prompt, str) else "input_ids"
        return "/generate", {key: req.prompt, "stream": True, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": req.output_len,
            "ignore_eos": not args.disable_ignore_eos}}
    common = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True},
              "ignore_eos": not args.disable_ignore_eos}
    if args.backend == "openai-chat":
        return "/v1/chat/completions", {**common, "messages": [
            {"role": "user", "content": req.prompt}]}
    return "/v1/completions", {**common, "prompt": req.prompt}


async def send(client: httpx.AsyncClient, args: argparse.Namespace, req: Request,
               model: str) -> Result:
    """One streaming request; token counts come from the server's own usage numbers.

    Native chunks repeat every output id so far (O(n) bytes each), so they are not parsed:
    the count is read from ``meta_info.completion_tokens`` with a regex and only the last chunk
    is parsed, which keeps this client far from being the bottleneck at high concurrency."""
    route, body = payload(args, req, model)
    res, t0 = Result(), time.perf_counter()
    last, seen, final = t0, 0, None
    try:
        async with client.stream("POST", args.base_url + route, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                i = line.rfind('"meta_info"') if args.backend == "sglang" else -1
                m = _COMPLETION_TOKENS.search(line, i) if i >= 0 else None
                if m is not None:
                    n, final = int(m.group(1)), line
                else:
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"])
                        return res
                    n = _tokens_so_far(args.backend, chunk, seen)
                    _read_usage(res, chunk)
                if n > seen:
                    if seen == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.extend([(now - last) / (n - seen)] * (n - seen))
                    last, seen = now, n
        res.e2e = time.perf_counter() - t0
        if final is not None:
            _read_usage(res, json.loads(final[6:]))
        res.output_len = res.output_len or seen
        res.ok = seen > 0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e} (cause {e.__cause__!r}, after {seen} tokens)"
    return res


_COMPLETION_TOKENS = re.compile(r'"completion_tokens": ?(\d+)')


def _read_usage(res: Result, chunk: dict) -> None:
    usage = chunk.get("usage") or chunk.get("meta_info")
    if usage:
        res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
        res.output_len = usage.get("completion_tokens", res.output_len)


def _tokens_so_far(backend: str, chunk: dict, seen: int) -> int:
    if backend == "sglang":
        return len(chunk.get("output_ids") or [])
    # OpenAI chunks carry text deltas; count each non-empty delta as one step of tokens
    choices = chunk.get("choices") or []
    text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                   for c in choices)
    return seen + 1 if text else seen


async def run(args: argparse.Namespace, reqs: list[Request], concurrency: int | None = None,
              flush: bool = False, time_limit_s: float | None = None,
              ) -> tuple[list[Result], float]:
    """Send ``reqs`` with at most ``concurrency`` in flight (None: no cap), after
    ``--warmup-requests`` unmeasured ones (the first prompts, 16 output tokens). ``flush``:
    ``POST /flush_cache`` first. Requests unfinished after ``time_limit_s`` seconds are
    cancelled (the server aborts them) and come back with ``error == CUT``.

    Returns (one Result per request, in order; duration in seconds from the first request)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model
        if args.backend != "sglang" and model is None:
            model = (await client.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
        if flush:
            r = await client.post(args.base_url + "/flush_cache")
            if r.status_code != 200:
                print(f"flush_cache answered {r.status_code}", file=sys.stderr)
        for req in reqs[:args.warmup_requests]:
            await send(client, args, Request(req.prompt, min(req.output_len, 16)), model)
        sem = asyncio.Semaphore(concurrency or max(len(reqs), 1))
        bar = Progress(len(reqs), args.disable_tqdm)
        rng = random.Random(args.seed)
        tasks: list[asyncio.Task] = []

        async def one(req: Request) -> Result:
            async with sem:
                res = await send(client, args, req, model)
            bar.update()
            return res

        async def launch() -> None:
            for req in reqs:
                tasks.append(asyncio.create_task(one(req)))
                if args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)

        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(launch(), time_limit_s)
        except asyncio.TimeoutError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - t0
        bar.close()
    results = [Result(error=CUT) if t.cancelled() else t.result() for t in tasks]
    return results + [Result(error=CUT) for _ in reqs[len(tasks):]], duration


class Progress:
    """tqdm when installed (and not disabled), else a plain "done/total" line on stderr."""

    def __init__(self, total: int, disable: bool):
        self.total, self.done, self.bar = total, 0, None
        if not disable:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="requests")
            except ImportError:
                pass
        self.disable = disable

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif not self.disable:
            print(f"\rrequests {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif not self.disable:
            print(file=sys.stderr)


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    """bench_serving's metrics; latencies in milliseconds. ``failed`` excludes ``cut``."""
    ok = [r for r in results if r.ok]
    cut = sum(r.error == CUT for r in results)
    out: dict[str, float] = {"completed": len(ok), "failed": len(results) - len(ok) - cut,
                             "cut": cut, "duration_s": duration}
    duration = max(duration, 1e-9)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    out.update(total_input_tokens=total_in, total_output_tokens=total_out,
               request_throughput=len(ok) / duration, input_throughput=total_in / duration,
               output_throughput=total_out / duration,
               total_throughput=(total_in + total_out) / duration,
               concurrency=sum(r.e2e for r in ok) / duration)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    series = {"ttft": [r.ttft for r in ok], "tpot": tpot,
              "itl": [x for r in ok for x in r.itl], "e2e": [r.e2e for r in ok]}
    for name, xs in series.items():
        ms = sorted(x * 1000 for x in xs) or [0.0]
        out[f"mean_{name}_ms"] = statistics.fmean(ms)
        out[f"median_{name}_ms"] = statistics.median(ms)
        out[f"p99_{name}_ms"] = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return out
