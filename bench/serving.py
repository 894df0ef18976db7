"""Online serving benchmark against a running server, in the manner of ``sglang.bench_serving``.

Sends streaming requests (native ``/generate``, ``/v1/completions`` or ``/v1/chat/completions``)
from ShareGPT prompts (``--dataset-path``, output length = ``completion_tokens_smollm2`` capped
by ``--max-output-len``) or random token ids, paced by ``--request-rate`` (Poisson, req/s) and/or
capped by ``--max-concurrency``, and prints a table: request / input / output throughput and
TTFT, TPOT, ITL, E2E latency (mean, median, p99) in milliseconds.

Definitions (sglang-facts.md section 7.4): TTFT = time to the first streamed chunk with
tokens; TPOT per request = (E2E - TTFT) / (output_len - 1); ITL = gaps between streamed chunks
(a chunk of k tokens counts as k gaps of gap/k); concurrency = sum(E2E) / duration.

    python -m server &                       # default SmolLM2 model on 127.0.0.1:30000
    python bench/serving.py --num-prompts 50 --max-concurrency 8 --max-output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Request:
    prompt: str | list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0


def load_requests(args: argparse.Namespace) -> list[Request]:
    """``--num-prompts`` requests from the ShareGPT file or random token ids."""
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        return [Request([rng.randrange(1, args.random_vocab_size)
                         for _ in range(args.random_input_len)], args.random_output_len)
                for _ in range(args.num_prompts)]
    reqs = []
    with open(args.dataset_path) as f:
        for line in f:
            row = json.loads(line)
            out = min(int(row.get("completion_tokens_smollm2") or args.max_output_len),
                      args.max_output_len)
            if row.get("prompt") and out > 0:
                reqs.append(Request(row["prompt"], out))
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
    """One streaming request; token counts come from the server's own usage numbers."""
    route, body = payload(args, req, model)
    res, t0 = Result(), time.perf_counter()
    last, seen = t0, 0
    try:
        async with client.stream("POST", args.base_url + route, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                n = _tokens_so_far(args.backend, chunk, seen)
                if n > seen:
                    if seen == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.extend([(now - last) / (n - seen)] * (n - seen))
                    last, seen = now, n
                usage = chunk.get("usage") or chunk.get("meta_info")
                if usage:
                    res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
                    res.output_len = usage.get("completion_tokens", res.output_len)
        res.e2e = time.perf_counter() - t0
        res.output_len = res.output_len or seen
        res.ok = seen > 0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _tokens_so_far(backend: str, chunk: dict, seen: int) -> int:
    if backend == "sglang":
        return len(chunk.get("output_ids") or [])
    # OpenAI chunks carry text deltas; count each non-empty delta as one step of tokens
    choices = chunk.get("choices") or []
    text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                   for c in choices)
    return seen + 1 if text else seen


async def run(args: argparse.Namespace, reqs: list[Request]) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model
        if args.backend != "sglang" and model is None:
            model = (await client.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency or len(reqs))
        bar = Progress(len(reqs), args.disable_tqdm)
        rng = random.Random(args.seed)

        async def one(req: Request) -> Result:
            async with sem:
                res = await send(client, args, req, model)
            bar.update()
            return res

        t0 = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(one(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return list(results), duration


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
    """bench_serving's metrics; latencies in milliseconds."""
    ok = [r for r in results if r.ok]
    out: dict[str, float] = {"completed": len(ok), "failed": len(results) - len(ok),
                             "duration_s": duration}
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


def print_table(m: dict[str, float], args: argparse.Namespace) -> None:
    rows = [("Backend", args.backend), ("Request rate (req/s)", args.request_rate),
            ("Max concurrency", args.max_concurrency or "-"),
            ("Successful requests", int(m["completed"])), ("Failed requests", int(m["failed"])),
            ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
            ("Total input tokens", int(m["total_input_tokens"])),
            ("Total output tokens", int(m["total_output_tokens"])),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("Input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{m['total_throughput']:.2f}"),
            ("Concurrency", f"{m['concurrency']:.2f}")]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", f"{m[f'{stat}_{name}_ms']:.2f}"))
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", default="sglang", choices=["sglang", "openai", "openai-chat"])
    p.add_argument("--model", default=None, help="OpenAI backends: default from /v1/models")
    p.add_argument("--dataset-name", default="sharegpt", choices=["sharegpt", "random"])
    p.add_argument("--dataset-path", default="../shared/data/sharegpt-prompts.jsonl")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--max-output-len", type=int, default=64,
                   help="cap on the ShareGPT output length (tokens)")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-vocab-size", type=int, default=500,
                   help="random prompts use token ids in [1, this)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate (req/s); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append the metrics as one JSON line")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reqs = load_requests(args)
    results, duration = asyncio.run(run(args, reqs))
    metrics = summarize(results, duration)
    print_table(metrics, args)
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"{len(errors)} failed; first error: {errors[0]}", file=sys.stderr)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                **metrics}) + "\n")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
